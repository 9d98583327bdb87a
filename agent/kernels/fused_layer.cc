// A whole decoder layer as one kernel, for a decode step (one new token of each of B sequences)
// and for a prefill (the S tokens of one prompt, row i at position i): RMSNorm, the Q, K and V
// products (+ bias), RoPE, the new K/V written into the cache, attention over each row's cached
// positions (rows sharing a table in blocks: prompt_attention.h), the output product + residual,
// RMSNorm, gate/up products, SwiGLU, down product + residual. Launched op by op, MindSpore spent
// about 14 ms of a 70 ms decode step (B = 16) between ~14 ops a layer and woke the kernels' thread
// team once an op; here the team is woken once a layer and its stages are separated by barriers
// (thread_team.h). FusedStack runs every layer of the model in one op, layer after layer, each
// layer's output the next one's input: one op a step instead of one a layer, each of whose launches
// MindSpore checked and counted its inputs (a decode step of 1 row 6.25 -> 5.95 ms, of 16 rows 32.0
// -> 30.7 ms: tools.model_bench, context 160, the 2-core EPYC); the per-layer graphs (MindIR
// exports) call it with one layer.
//
// MindSpore AOT custom-op interface (CPU), float32 unless said:
//   0 x [N, D]   1 cos [N, 1, hd]   2 sin [N, 1, hd] (rotate-half sign folded in)
//   3 write [N KV] int32: cache row of each (row, KV head)'s new K/V, row-major;
//   4 len [N KV] int32: positions that (row, head) attends, its own included: positions
//     0 .. len - 1 of its sequence, read through its block table. Rows whose len is 0 are padding
//     (batch or prompt bucket), all at the end: nothing is computed for them and their output is
//     their input;
//   5 eps [1] or [2]: the RMSNorms' epsilon (then the attention scale)   6 tables [T, MB] int32: block tables, MB blocks each   7 row_table [N] int32: the
//   table of each row (a decode step: row b's own, 0..N-1; a prompt chunk: all 0, one sequence)
//   8 block_size [1] int32: B
//   9 cos_local, 10 sin_local, 11 write_local, 12 tables_local: what a sliding-window ("local")
//   layer takes in place of 1, 2, 3 and 6 (its own RoPE base; its own cache, whose table recycles
//   the blocks a window has left behind); the same tensors again for a model without such layers
//   then each layer's 18 inputs: attn_norm [D], bqkv [(H + 2 KV) hd], k_cache [R, hd], v_cache
//   [R, hd] (paged, R = blocks * KV * B: position p of KV head h of a sequence with block table T
//   is row (T[p / B] * KV + h) * B + p % B, row_ops.h Paged; or uint8 [R, hd / 32 * 34], a q8_0
//   cache: kv_rows.h), ffn_norm [D], formats [7] int32 (the
//   format of each matrix, product.h), wq, wk, wv, wo, w_gate, w_up, w_down (rows as output columns,
//   packed: product.h read_matrix), q_norm [hd], k_norm [hd], post_attn_norm [D], post_ffn_norm [D]
//   (each [1] and unread where the layer has none), options [5] int32: the sliding window (0: none,
//   else the positions a row attends, its own included), local (1: inputs 9-12), the activation
//   (0 SwiGLU, 1 GeGLU with tanh GELU), QK-norm (1: each query and key head RMS-normed by q_norm,
//   k_norm before RoPE), post-norms (1: the attention's and the FFN's outputs RMS-normed by
//   post_attn_norm, post_ffn_norm before their residual adds: Gemma's four norms a layer);
//   output [N, D] last.
// Matrices of one layer may differ in format (a Q4_K_M file's attn_v and ffn_down are Q6_K in half
// the layers). The attention scale, 1 / sqrt(hd) or eps's second value where it has one (Gemma's
// query_pre_attn_scalar), is applied to the queries after their product.
// The K/V caches are written in place: they are the layer's cache Parameters (or, in an exported
// MindIR graph, the cache inputs), which no other op of the graph reads. The host computes `write`
// from the tables and checks every index; the kernel refuses (returns 1) a call whose tables,
// row_table or len would read outside the cache, or whose shapes do not fit together.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "entry.h"
#include "int8_products.h"
#include "product.h"
#include "prompt_attention.h"
#include "row_ops.h"
#include "thread_team.h"

namespace {

using packed::TILE;

constexpr int64_t MAX_HEAD_DIM = 512;  // one head's bias-added row lives on the stack
constexpr int COMMON = 13, PER_LAYER = 18, MATRICES = 7, OPTIONS = 5;
enum { WQ, WK, WV, WO, W_GATE, W_UP, W_DOWN };

int64_t padded(int64_t n) { return (n + TILE - 1) / TILE * TILE; }

// The block tables of a call.
struct Paging {
  const int32_t *tables, *row_table;
  int64_t table_rows, entries, block;

  const int32_t *table(int64_t row) const {
    return tables + static_cast<int64_t>(row_table[row]) * entries;
  }
};

// Where a layer's RoPE, cache writes and block tables come from: the global layers' (inputs 1, 2, 3,
// 6) or the sliding-window layers' (9-12).
struct Positions {
  const float *cos, *sin;
  const int32_t *write;
  Paging paging;
};

// The inputs every layer of a call shares (0-12).
struct Step {
  Positions global, local;
  const int32_t *len;
  float eps, scale;  // scale: 0 for 1 / sqrt(hd)
  int64_t batch, dim, kv;
};

// One layer's own inputs.
struct Layer {
  const float *attn_norm, *bqkv, *ffn_norm;
  const float *q_norm = nullptr, *k_norm = nullptr, *post_attn_norm = nullptr, *post_ffn_norm = nullptr;
  kvrows::Cache k_cache, v_cache;
  int64_t cache_rows, hd, bias;
  int64_t window = 0;  // positions a row attends (0: all it has)
  bool local = false, geglu = false;
  product::Matrix m[MATRICES];
};

// RoPE tables at cos, sin; write rows at write; block tables at tables (the step's row_table, block).
bool read_positions(void **params, int *ndims, int64_t **shapes, int cos, int sin, int write, int tables,
                    Positions &at) {
  if (ndims[cos] != 3 || ndims[sin] != 3 || ndims[write] != 1 || ndims[tables] != 2 ||
      shapes[cos][0] != shapes[0][0] || shapes[sin][0] != shapes[0][0] || shapes[cos][2] != shapes[sin][2] ||
      shapes[write][0] != shapes[4][0])
    return false;
  at.cos = static_cast<const float *>(params[cos]);
  at.sin = static_cast<const float *>(params[sin]);
  at.write = static_cast<const int32_t *>(params[write]);
  at.paging = {static_cast<const int32_t *>(params[tables]), static_cast<const int32_t *>(params[7]),
               shapes[tables][0], shapes[tables][1], *static_cast<const int32_t *>(params[8])};
  return true;
}

bool read_step(void **params, int *ndims, int64_t **shapes, Step &step) {
  if (ndims[0] != 2 || ndims[4] != 1 || ndims[5] != 1 || ndims[7] != 1 || ndims[8] != 1 ||
      shapes[7][0] != shapes[0][0] || shapes[8][0] != 1 || shapes[5][0] < 1 || shapes[5][0] > 2 ||
      shapes[0][0] <= 0 || shapes[4][0] % shapes[0][0] != 0)
    return false;
  step.batch = shapes[0][0], step.dim = shapes[0][1], step.kv = shapes[4][0] / step.batch;
  step.len = static_cast<const int32_t *>(params[4]);
  const float *eps = static_cast<const float *>(params[5]);
  step.eps = eps[0], step.scale = shapes[5][0] == 2 ? eps[1] : 0.f;
  return read_positions(params, ndims, shapes, 1, 2, 3, 6, step.global) &&
         read_positions(params, ndims, shapes, 9, 10, 11, 12, step.local) && step.global.paging.block > 0 &&
         step.kv > 0;
}

// Layer inputs at `first` (the 18 of the interface); false where they do not fit each other or the step.
bool read_layer(void **params, int *ndims, int64_t **shapes, int first, const Step &step, Layer &layer) {
  const int at = first;
  if (ndims[at] != 1 || ndims[at + 1] != 1 || ndims[at + 2] != 2 || ndims[at + 3] != 2 || ndims[at + 4] != 1 ||
      ndims[at + 5] != 1 || shapes[at + 5][0] != MATRICES || shapes[at][0] != step.dim ||
      shapes[at + 4][0] != step.dim || ndims[at + 17] != 1 || shapes[at + 17][0] != OPTIONS)
    return false;
  for (int i = 13; i < 17; ++i)
    if (ndims[at + i] != 1) return false;
  const int32_t *options = static_cast<const int32_t *>(params[at + 17]);
  layer.window = options[0], layer.local = options[1] != 0, layer.geglu = options[2] != 0;
  const bool qk_norm = options[3] != 0, post_norms = options[4] != 0;
  if (layer.window < 0 || options[2] < 0 || options[2] > 1) return false;
  const int64_t head_dim = shapes[layer.local ? 9 : 1][2];  // the RoPE tables'
  if (qk_norm) {
    if (shapes[at + 13][0] != head_dim || shapes[at + 14][0] != head_dim) return false;
    layer.q_norm = static_cast<const float *>(params[at + 13]);
    layer.k_norm = static_cast<const float *>(params[at + 14]);
  }
  if (post_norms) {
    if (shapes[at + 15][0] != step.dim || shapes[at + 16][0] != step.dim) return false;
    layer.post_attn_norm = static_cast<const float *>(params[at + 15]);
    layer.post_ffn_norm = static_cast<const float *>(params[at + 16]);
  }
  const int32_t *formats = static_cast<const int32_t *>(params[at + 5]);
  for (int i = 0; i < MATRICES; ++i)
    if (!product::read_matrix(params[at + 6 + i], formats[i], ndims[at + 6 + i], shapes[at + 6 + i], layer.m[i]))
      return false;
  layer.attn_norm = static_cast<const float *>(params[at]);
  layer.bqkv = static_cast<const float *>(params[at + 1]);
  if (!kvrows::Cache::of(params[at + 2], shapes[at + 2][1], head_dim, layer.k_cache) ||
      !kvrows::Cache::of(params[at + 3], shapes[at + 3][1], head_dim, layer.v_cache) ||
      shapes[at + 3][1] != shapes[at + 2][1])
    return false;
  layer.ffn_norm = static_cast<const float *>(params[at + 4]);
  layer.cache_rows = shapes[at + 2][0], layer.hd = head_dim, layer.bias = shapes[at + 1][0];
  const int64_t hd = layer.hd, kv_width = step.kv * hd, q_width = layer.bias - 2 * kv_width;
  const product::Matrix *m = layer.m;
  const int64_t ffn = m[W_DOWN].k_dim;
  return shapes[at + 3][0] == layer.cache_rows && hd <= MAX_HEAD_DIM &&
         q_width > 0 && q_width % (step.kv * hd) == 0 && step.dim % TILE == 0 &&
         m[WQ].n_dim() == padded(q_width) && m[WK].n_dim() == padded(kv_width) &&
         m[WV].n_dim() == padded(kv_width) && m[WQ].k_dim == step.dim && m[WK].k_dim == step.dim &&
         m[WV].k_dim == step.dim && m[WO].k_dim == q_width && m[WO].n_dim() == step.dim &&
         m[W_GATE].k_dim == step.dim && m[W_UP].k_dim == step.dim && m[W_GATE].n_dim() == padded(ffn) &&
         m[W_UP].n_dim() == padded(ffn) && m[W_DOWN].n_dim() == step.dim;
}

// Matrices computed as one product into one buffer, each at its own columns (Q, K and V; gate and
// up): tile j of the whole is tile j - first of one of them.
struct Parts {
  const product::Matrix *m[3];
  int count;

  int64_t tiles() const {
    int64_t n = 0;
    for (int i = 0; i < count; ++i) n += m[i]->tiles;
    return n;
  }
  int64_t width() const { return tiles() * TILE; }
  template <class Use>
  void at(int64_t j, Use use) const {  // use(matrix, its tile, its first output column)
    int64_t column = 0;
    for (int i = 0; i < count; ++i) {
      if (j < m[i]->tiles) return use(*m[i], j, column);
      j -= m[i]->tiles;
      column += m[i]->n_dim();
    }
  }
};

int run_layer(const float *x, const Step &step, const Layer &layer, bool int8_activations, float *out) {
  const int64_t batch = step.batch, dim = step.dim, kv = step.kv, hd = layer.hd;
  const int64_t q_width = layer.bias - 2 * kv * hd, heads = q_width / hd, groups = heads / kv;
  const product::Matrix *m = layer.m;
  const int64_t ffn = m[W_DOWN].k_dim;
  const Parts qkv_parts{{&m[WQ], &m[WK], &m[WV]}, 3}, gate_up_parts{{&m[W_GATE], &m[W_UP]}, 2};
  const int64_t qkv_stride = qkv_parts.width(), gate_up_stride = gate_up_parts.width();
  const int64_t k_column = m[WQ].n_dim(), v_column = k_column + m[WK].n_dim(), up_column = m[W_GATE].n_dim();
  const float scale = step.scale > 0.f ? step.scale : 1.f / std::sqrt(static_cast<float>(hd));
  const Positions &at_positions = layer.local ? step.local : step.global;
  const Paging &paging = at_positions.paging;
  const int32_t *write = at_positions.write, *len = step.len;
  const int64_t window = layer.window;
  const kvrows::Cache &k_cache = layer.k_cache, &v_cache = layer.v_cache;

  int64_t live = 0;  // rows before the padding
  while (live < batch && len[live * kv] > 0) ++live;
  const int64_t cache_rows = layer.cache_rows, blocks = cache_rows / (kv * paging.block);
  if (cache_rows % (kv * paging.block) != 0) return 1;
  for (int64_t n = 0; n < live * kv; ++n) {  // every block read and row written lies in the cache
    const int32_t table_row = paging.row_table[n / kv];
    if (table_row < 0 || table_row >= paging.table_rows || write[n] < 0 || write[n] >= cache_rows ||
        !rowwise::table_covers(paging.table(n / kv), paging.entries, paging.block, len[n], blocks))
      return 1;
  }
  // The opt-in int8 products (int8_products.h) take the integer formats' products; each product's
  // input is quantized first.
  if (int8_activations && !int8::AVAILABLE) return 1;
  thread_local std::vector<int8_t> xq_buf;
  thread_local std::vector<float> xd_buf, xs_buf;
  if (int8_activations) {
    const int64_t widest = std::max({dim, q_width, ffn});
    if (widest % int8::XBLOCK != 0) return 1;
    xq_buf.resize(live * widest);
    xd_buf.resize(live * widest / int8::XBLOCK);
    xs_buf.resize(live * widest / int8::XSUM);
  }
  // The product's input quantized, k_dim wide: one set of buffers, each product's in turn (their
  // addresses taken here: in the team's threads the thread_local names are other vectors).
  int8_t *const xq = xq_buf.data();
  float *const xd = xd_buf.data(), *const xs = xs_buf.data();
  auto activations = [=](int64_t k_dim) { return int8::Rows{xq, xd, xs, k_dim}; };
  // Before a product: its input's rows quantized (int8_activations only), then the team's barrier.
  auto quantize = [&](team::Region &region, const float *in, int64_t k_dim) {
    if (int8_activations)
      region.for_static(live, [&](int64_t row) { int8::quantize_row(activations(k_dim), in, row); });
  };
  // Tile j of the matrix into `to`'s columns from `column` on (rows of `stride`).
  auto product = [&](const product::Matrix &w, const float *in, const float *residual, float *to, int64_t stride,
                     int64_t j) {
    if (!int8_activations || !int8::tile(w, activations(w.k_dim), residual, to, live, stride, j))
      product::tile(w, in, residual, to, live, stride, j);
  };
  std::memcpy(out + live * dim, x + live * dim, sizeof(float) * (batch - live) * dim);
  const int64_t live_rows = live * kv;

  // Activations between the stages, reused across calls (this is MindSpore's launching thread).
  thread_local std::vector<float> qkv_buf, q_buf, attn_buf, x1_buf, gate_up_buf, act_buf, post_buf;
  qkv_buf.resize(batch * qkv_stride);
  q_buf.resize(batch * q_width);
  attn_buf.resize(batch * q_width);
  x1_buf.resize(batch * dim);
  gate_up_buf.resize(batch * gate_up_stride);
  act_buf.resize(batch * ffn);
  const bool post_norms = layer.post_attn_norm != nullptr;
  if (post_norms) post_buf.resize(batch * dim);  // wo's and w_down's products before their norms
  float *qkv = qkv_buf.data(), *q = q_buf.data(), *attn = attn_buf.data(), *x1 = x1_buf.data();
  float *gate_up = gate_up_buf.data(), *act = act_buf.data(), *post = post_buf.data();

  // Attention's work items: blocks of rows sharing a table (prompt_attention.h), per KV head.
  const std::vector<prompt_attention::Block> blocks_todo =
      prompt_attention::find_blocks(paging.row_table, live, kv, groups, team::Team::instance().size());
  const int64_t n_attend = static_cast<int64_t>(blocks_todo.size());

  const float *bqkv = layer.bqkv;
  team::Team::instance().run([&](team::Region &region) {
    // Each thread normalises all rows itself (a few us) rather than waiting at one more barrier.
    thread_local std::vector<float> normed;
    normed.resize(batch * dim);
    float *h = normed.data();
    for (int64_t b = 0; b < live; ++b) rowwise::rms_norm(x + b * dim, layer.attn_norm, step.eps, dim, h + b * dim);
    quantize(region, h, dim);
    region.for_dynamic(qkv_parts.tiles(), 2, [&](int64_t j) {
      qkv_parts.at(j, [&](const product::Matrix &w, int64_t tile, int64_t column) {
        product(w, h, nullptr, qkv + column, qkv_stride, tile);
      });
    });

    // Per (row, KV head): bias, RoPE of its query heads (scaled) and key, K/V into the cache; then,
    // once all are written (a prompt's rows attend to each other's), attention. With QK-norm each
    // query and key head is RMS-normed before its RoPE.
    const float *q_norm = layer.q_norm, *k_norm = layer.k_norm;
    region.for_static(live_rows, [&](int64_t n) {
      const int64_t b = n / kv, head = n % kv;
      const float *row = qkv + b * qkv_stride, *c = at_positions.cos + b * hd, *s = at_positions.sin + b * hd;
      float biased[MAX_HEAD_DIM];
      for (int64_t g = 0; g < groups; ++g) {
        const int64_t at = (head * groups + g) * hd;
        for (int64_t d = 0; d < hd; ++d) biased[d] = row[at + d] + bqkv[at + d];
        if (q_norm != nullptr) rowwise::rms_norm(biased, q_norm, step.eps, hd, biased);
        for (int64_t d = 0; d < hd; ++d) biased[d] *= scale;
        rowwise::rope(biased, c, s, hd, q + (n * groups + g) * hd);
      }
      const int64_t k_at = k_column + head * hd, v_at = v_column + head * hd;
      const int64_t k_bias = q_width + head * hd, v_bias = q_width + (kv + head) * hd;
      for (int64_t d = 0; d < hd; ++d) biased[d] = row[k_at + d] + bqkv[k_bias + d];
      if (k_norm != nullptr) rowwise::rms_norm(biased, k_norm, step.eps, hd, biased);
      float roped[MAX_HEAD_DIM];
      rowwise::rope(biased, c, s, hd, roped);
      kvrows::store(k_cache, write[n], roped, hd);
      for (int64_t d = 0; d < hd; ++d) biased[d] = row[v_at + d] + bqkv[v_bias + d];
      kvrows::store(v_cache, write[n], biased, hd);
    });
    region.for_dynamic(n_attend, 1, [&](int64_t i) {
      const prompt_attention::Block &w = blocks_todo[i];
      const rowwise::Paged at{paging.table(w.b0), kv, paging.block, w.head};
      prompt_attention::attend_block(w, at, k_cache, v_cache, q, len, kv, groups, hd, window, attn);
    });

    quantize(region, attn, q_width);
    if (post_norms) {  // x1 = x + norm(attn @ wo)
      region.for_dynamic(m[WO].tiles, 2, [&](int64_t j) { product(m[WO], attn, nullptr, post, dim, j); });
      region.for_static(live, [&](int64_t b) {
        float *row = x1 + b * dim;
        rowwise::rms_norm(post + b * dim, layer.post_attn_norm, step.eps, dim, row);
        for (int64_t d = 0; d < dim; ++d) row[d] += x[b * dim + d];
      });
    } else {
      region.for_dynamic(m[WO].tiles, 2, [&](int64_t j) { product(m[WO], attn, x, x1, dim, j); });
    }

    for (int64_t b = 0; b < live; ++b) rowwise::rms_norm(x1 + b * dim, layer.ffn_norm, step.eps, dim, h + b * dim);
    quantize(region, h, dim);
    region.for_dynamic(gate_up_parts.tiles(), 2, [&](int64_t j) {
      gate_up_parts.at(j, [&](const product::Matrix &w, int64_t tile, int64_t column) {
        product(w, h, nullptr, gate_up + column, gate_up_stride, tile);
      });
    });

    region.for_static(live, [&](int64_t b) {
      const float *g = gate_up + b * gate_up_stride;
      if (layer.geglu)
        rowwise::geglu(g, g + up_column, ffn, act + b * ffn);
      else
        rowwise::swiglu(g, g + up_column, ffn, act + b * ffn);
    });

    quantize(region, act, ffn);
    if (post_norms) {  // out = x1 + norm(act @ w_down)
      region.for_dynamic(m[W_DOWN].tiles, 2, [&](int64_t j) { product(m[W_DOWN], act, nullptr, post, dim, j); });
      region.for_static(live, [&](int64_t b) {
        float *row = out + b * dim;
        rowwise::rms_norm(post + b * dim, layer.post_ffn_norm, step.eps, dim, row);
        for (int64_t d = 0; d < dim; ++d) row[d] += x1[b * dim + d];
      });
    } else {
      region.for_dynamic(m[W_DOWN].tiles, 2, [&](int64_t j) { product(m[W_DOWN], act, x1, out, dim, j); });
    }
  });
  return 0;
}

// The stack's call: the common inputs, then PER_LAYER inputs a layer, the output last.
int run_stack(int nparam, void **params, int *ndims, int64_t **shapes, bool int8_activations) {
  Step step;
  if (nparam < COMMON + PER_LAYER + 1 || (nparam - COMMON - 1) % PER_LAYER != 0 ||
      !read_step(params, ndims, shapes, step))
    return 1;
  const int layers = (nparam - COMMON - 1) / PER_LAYER;
  std::vector<Layer> each(layers);
  for (int layer = 0; layer < layers; ++layer)
    if (!read_layer(params, ndims, shapes, COMMON + layer * PER_LAYER, step, each[layer])) return 1;
  float *out = static_cast<float *>(params[nparam - 1]);
  // Layers alternate between out and this buffer so that the last one writes out.
  thread_local std::vector<float> other_buf;
  other_buf.resize(step.batch * step.dim);
  const float *x = static_cast<const float *>(params[0]);
  for (int layer = 0; layer < layers; ++layer) {
    float *to = (layers - 1 - layer) % 2 == 0 ? out : other_buf.data();
    const int failed = run_layer(x, step, each[layer], int8_activations, to);
    if (failed) return failed;
    x = to;
  }
  return 0;
}

}  // namespace

KERNEL_ENTRY int FusedStack(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes,
                          void *stream, void *extra) {
  (void)stream; (void)extra; (void)dtypes;
  return run_stack(nparam, params, ndims, shapes, false);
}

// FusedStack with the opt-in int8 products for the integer formats' matrices.
KERNEL_ENTRY int FusedStackI8(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes,
                            void *stream, void *extra) {
  (void)stream; (void)extra; (void)dtypes;
  return run_stack(nparam, params, ndims, shapes, true);
}
