// One whole decoder layer as one kernel, for a decode step (one new token of each of B sequences)
// and for a prefill (the S tokens of one prompt, row i at position i): RMSNorm, the fused QKV
// product (+ bias), RoPE, the new K/V written into the cache, attention over each row's cached
// positions (a prompt chunk's rows as products: prompt_attention.h), the output product + residual,
// RMSNorm, gate/up product, SwiGLU, down product + residual. Launched op by op, MindSpore spent
// about 14 ms of a 70 ms decode step (B = 16) between ~14 ops a layer and woke the kernels' thread
// team once an op; here the team is woken once a layer and its stages are separated by barriers
// (thread_team.h).
//
// MindSpore AOT custom-op interface (CPU), float32 unless said:
//   0 x [N, D]             1 attn_norm [D]           2 wqkv [Tq, D, TILE] (packed_matmul.h)
//   3 bqkv [(H + 2 KV) hd] 4 cos [N, 1, hd]          5 sin [N, 1, hd] (rotate-half sign folded in)
//   6 k_cache [R, hd]      7 v_cache [R, hd]: paged, R = blocks * KV * B; position p of KV head h
//     of a sequence with block table T is row (T[p / B] * KV + h) * B + p % B (row_ops.h Paged);
//   8 write [N KV] int32: cache row of each (row, KV head)'s new K/V, row-major;
//   9 len [N KV] int32: positions that (row, head) attends, its own included: positions
//     0 .. len - 1 of its sequence, read through its block table. Rows whose len is 0 are padding
//     (batch or prompt bucket), all at the end: nothing is computed for them and their output is
//     their input;
//   10 wo [D / TILE, H hd, TILE]   11 ffn_norm [D]   12 w_gate_up [Tg, D, TILE] (gate columns, then
//   up)   13 w_down [D / TILE, F, TILE]   14 eps [1]
//   15 tables [T, MB] int32: block tables, MB blocks each   16 row_table [N] int32: the table of
//   each row (a decode step: row b's own, 0..N-1; a prompt chunk: all 0, one sequence)
//   17 block_size [1] int32: B
//   output [N, D]. The attention scale is folded into the Q rows of wqkv and bqkv.
// The K/V caches are written in place: they are the layer's cache Parameters (or, in an exported
// MindIR graph, the cache inputs), which no other op of the graph reads. The host computes `write`
// from the tables and checks every index; the kernel refuses (returns 1) a call whose tables,
// row_table or len would read outside the cache.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "packed_matmul.h"
#include "prompt_attention.h"
#include "row_ops.h"
#include "thread_team.h"

namespace {

using packed::TILE;

constexpr int64_t MAX_HEAD_DIM = 512;  // one head's bias-added row lives on the stack

int64_t padded(int64_t n) { return (n + TILE - 1) / TILE * TILE; }


// The block tables of a call: inputs tables, row_table and block_size (at `first`, `first` + 1, + 2).
struct Paging {
  const int32_t *tables, *row_table;
  int64_t table_rows, entries, block;

  const int32_t *table(int64_t row) const {
    return tables + static_cast<int64_t>(row_table[row]) * entries;
  }
};

bool read_paging(void **params, int *ndims, int64_t **shapes, int first, Paging &paging) {
  if (ndims[first] != 2 || ndims[first + 1] != 1 || ndims[first + 2] != 1 ||
      shapes[first + 1][0] != shapes[0][0] || shapes[first + 2][0] != 1)
    return false;
  paging.tables = static_cast<const int32_t *>(params[first]);
  paging.row_table = static_cast<const int32_t *>(params[first + 1]);
  paging.table_rows = shapes[first][0];
  paging.entries = shapes[first][1];
  paging.block = *static_cast<const int32_t *>(params[first + 2]);
  return paging.block > 0;
}

int run_layer(void **params, int64_t **shapes, const uint8_t *const q4w[4], bool int8, const Paging &paging,
              float *out) {
  const int64_t batch = shapes[0][0], dim = shapes[0][1], hd = shapes[6][1];
  const int64_t kv_rows = shapes[8][0], kv = kv_rows / batch;
  const int64_t q_width = shapes[10][1], heads = q_width / hd, groups = heads / kv;
  const int64_t ffn = shapes[13][1];
  const int64_t qkv_width = (heads + 2 * kv) * hd, qkv_stride = padded(qkv_width);
  const int64_t gate_up_stride = padded(2 * ffn);
  if (kv_rows % batch != 0 || heads % kv != 0 || shapes[3][0] != qkv_width ||
      shapes[2][0] * TILE != qkv_stride || shapes[12][0] * TILE != gate_up_stride ||
      shapes[10][0] * TILE != dim || shapes[13][0] * TILE != dim || shapes[2][1] != dim ||
      shapes[12][1] != dim || hd > MAX_HEAD_DIM)
    return 1;

  const float *x = static_cast<const float *>(params[0]);
  const float *attn_norm = static_cast<const float *>(params[1]);
  const float *wqkv = static_cast<const float *>(params[2]);
  const float *bqkv = static_cast<const float *>(params[3]);
  const float *cos = static_cast<const float *>(params[4]);
  const float *sin = static_cast<const float *>(params[5]);
  float *k_cache = static_cast<float *>(params[6]);
  float *v_cache = static_cast<float *>(params[7]);
  const int32_t *write = static_cast<const int32_t *>(params[8]);
  const int32_t *len = static_cast<const int32_t *>(params[9]);
  const float *wo = static_cast<const float *>(params[10]);
  const float *ffn_norm = static_cast<const float *>(params[11]);
  const float *w_gate_up = static_cast<const float *>(params[12]);
  const float *w_down = static_cast<const float *>(params[13]);
  const float eps = *static_cast<const float *>(params[14]);

  int64_t live = 0;  // rows before the padding
  while (live < batch && len[live * kv] > 0) ++live;
  const int64_t cache_rows = shapes[6][0], blocks = cache_rows / (kv * paging.block);
  if (shapes[7][0] != cache_rows || cache_rows % (kv * paging.block) != 0) return 1;
  for (int64_t n = 0; n < live * kv; ++n) {  // every block read and row written lies in the cache
    const int32_t table_row = paging.row_table[n / kv];
    if (table_row < 0 || table_row >= paging.table_rows || write[n] < 0 || write[n] >= cache_rows ||
        !rowwise::table_covers(paging.table(n / kv), paging.entries, paging.block, len[n], blocks))
      return 1;
  }
  // Q4_1 copies of wqkv, wo, w_gate_up, w_down (packed_matmul.h q4), or null
  const bool quantized = q4w[0] != nullptr;
  if (int8 && (!quantized || !q4i8::AVAILABLE)) return 1;
  // The opt-in int8 products (q4i8) take calls of more than q4i8::ABOVE_ROWS rows; each product's input
  // is quantized first.
  const bool int8_rows = int8 && live > q4i8::ABOVE_ROWS;
  thread_local std::vector<int8_t> xq_buf;
  thread_local std::vector<float> xd_buf, xs_buf;
  if (int8_rows) {
    const int64_t widest = std::max({dim, q_width, ffn});
    if (widest % q4i8::BLOCK != 0) return 1;
    xq_buf.resize(live * widest);
    xd_buf.resize(live * widest / q4i8::BLOCK);
    xs_buf.resize(live * widest / q4i8::BLOCK);
  }
  // The product's input quantized, k_dim wide: one set of buffers, each product's in turn (their
  // addresses taken here: in the team's threads the thread_local names are other vectors).
  int8_t *const xq = xq_buf.data();
  float *const xd = xd_buf.data(), *const xs = xs_buf.data();
  auto activations = [=](int64_t k_dim) { return q4i8::Rows{xq, xd, xs, k_dim}; };
  // Before a product: its input's rows quantized (int8_rows only), then the team's barrier.
  auto quantize = [&](team::Region &region, const float *in, int64_t k_dim) {
    if (int8_rows) region.for_static(live, [&](int64_t row) { q4i8::quantize_row(activations(k_dim), in, row); });
  };
  // tile j of x @ W (+ residual) into out (rows of n_dim), from weights `which` (0 qkv, 1 wo, 2 gate/up, 3 down)
  auto product = [&](int which, const float *w, const float *in, const float *residual, float *to,
                     int64_t k_dim, int64_t n_dim, int64_t j) {
    if (int8_rows) q4i8::tile(activations(k_dim), q4w[which], residual, to, live, n_dim, j);
    else if (quantized) q4::tile(in, q4w[which], residual, to, live, k_dim, n_dim, j);
    else packed::tile(in, w, residual, to, live, k_dim, n_dim, j);
  };
  std::memcpy(out + live * dim, x + live * dim, sizeof(float) * (batch - live) * dim);
  const int64_t live_rows = live * kv;

  // Activations between the stages, reused across calls (this is MindSpore's launching thread).
  thread_local std::vector<float> qkv_buf, q_buf, attn_buf, x1_buf, gate_up_buf, act_buf;
  qkv_buf.resize(batch * qkv_stride);
  q_buf.resize(batch * q_width);
  attn_buf.resize(batch * q_width);
  x1_buf.resize(batch * dim);
  gate_up_buf.resize(batch * gate_up_stride);
  act_buf.resize(batch * ffn);
  float *qkv = qkv_buf.data(), *q = q_buf.data(), *attn = attn_buf.data(), *x1 = x1_buf.data();
  float *gate_up = gate_up_buf.data(), *act = act_buf.data();

  // Prompt chunks (runs of rows sharing a table) attend as products; the other rows one by one.
  struct Block { int64_t run, head, b0, b1; };
  struct Pack { int64_t run, head, tile; };
  std::vector<prompt_attention::Run> runs;
  if (hd % TILE == 0) runs = prompt_attention::find_runs(paging.row_table, len, live, kv);
  std::vector<Pack> packs;
  std::vector<Block> blocks_todo;
  std::vector<int64_t> single_rows;
  std::vector<bool> in_run(live, false);
  thread_local std::vector<float> run_buf;  // the runs' packed keys and values, kept across calls
  int64_t run_floats = 0;
  for (const auto &run : runs) run_floats += 2 * kv * run.padded() * hd;
  run_buf.resize(run_floats);
  for (int64_t r = 0, at = 0; r < static_cast<int64_t>(runs.size()); ++r) {
    auto &run = runs[r];
    run.keys = run_buf.data() + at;
    run.values = run.keys + kv * run.padded() * hd;
    at += 2 * kv * run.padded() * hd;
    for (int64_t head = 0; head < kv; ++head) {
      for (int64_t t = 0; t < prompt_attention::tiles_of(run.length); ++t) packs.push_back({r, head, t});
      for (int64_t b0 = run.first; b0 < run.first + run.rows; b0 += prompt_attention::BLOCK_ROWS)
        blocks_todo.push_back({r, head, b0, std::min(b0 + prompt_attention::BLOCK_ROWS, run.first + run.rows)});
    }
    std::fill(in_run.begin() + run.first, in_run.begin() + run.first + run.rows, true);
  }
  for (int64_t n = 0; n < live_rows; ++n)
    if (!in_run[n / kv]) single_rows.push_back(n);
  const int64_t n_packs = static_cast<int64_t>(packs.size()), n_blocks = static_cast<int64_t>(blocks_todo.size());
  const int64_t n_attend = n_blocks + static_cast<int64_t>(single_rows.size());

  team::Team::instance().run([&](team::Region &region) {
    // Each thread normalises all rows itself (a few us) rather than waiting at one more barrier.
    thread_local std::vector<float> normed;
    normed.resize(batch * dim);
    float *h = normed.data();
    for (int64_t b = 0; b < live; ++b) rowwise::rms_norm(x + b * dim, attn_norm, eps, dim, h + b * dim);
    quantize(region, h, dim);
    region.for_dynamic(qkv_stride / TILE, 2,
                       [&](int64_t j) { product(0, wqkv, h, nullptr, qkv, dim, qkv_stride, j); });

    // Per (row, KV head): bias, RoPE of its query heads and key, K/V into the cache; then, once all
    // are written (a prompt's rows attend to each other's), attention.
    region.for_static(live_rows, [&](int64_t n) {
      const int64_t b = n / kv, head = n % kv;
      const float *row = qkv + b * qkv_stride, *c = cos + b * hd, *s = sin + b * hd;
      float biased[MAX_HEAD_DIM];
      for (int64_t g = 0; g < groups; ++g) {
        const int64_t at = (head * groups + g) * hd;
        for (int64_t d = 0; d < hd; ++d) biased[d] = row[at + d] + bqkv[at + d];
        rowwise::rope(biased, c, s, hd, q + (n * groups + g) * hd);
      }
      const int64_t k_at = (heads + head) * hd, v_at = (heads + kv + head) * hd;
      for (int64_t d = 0; d < hd; ++d) biased[d] = row[k_at + d] + bqkv[k_at + d];
      rowwise::rope(biased, c, s, hd, k_cache + static_cast<int64_t>(write[n]) * hd);
      float *v_row = v_cache + static_cast<int64_t>(write[n]) * hd;
      for (int64_t d = 0; d < hd; ++d) v_row[d] = row[v_at + d] + bqkv[v_at + d];
    });
    region.for_dynamic(n_packs, 4, [&](int64_t i) {
      const auto &run = runs[packs[i].run];
      const rowwise::Paged at{paging.table(run.first), kv, paging.block, packs[i].head};
      prompt_attention::pack_tile(run, k_cache, v_cache, at, hd, packs[i].tile);
    });
    region.for_dynamic(n_attend, 1, [&](int64_t i) {
      if (i < n_blocks) {
        const Block &w = blocks_todo[i];
        prompt_attention::attend_block(runs[w.run], q, len, kv, groups, hd, w.head, w.b0, w.b1, attn);
        return;
      }
      const int64_t n = single_rows[i - n_blocks];
      const rowwise::Paged at{paging.table(n / kv), kv, paging.block, n % kv};
      rowwise::attend_paged(q + n * groups * hd, k_cache, v_cache, at, len[n], groups, hd,
                            attn + n * groups * hd);
    });

    quantize(region, attn, q_width);
    region.for_dynamic(dim / TILE, 2, [&](int64_t j) { product(1, wo, attn, x, x1, q_width, dim, j); });

    for (int64_t b = 0; b < live; ++b) rowwise::rms_norm(x1 + b * dim, ffn_norm, eps, dim, h + b * dim);
    quantize(region, h, dim);
    region.for_dynamic(gate_up_stride / TILE, 2, [&](int64_t j) {
      product(2, w_gate_up, h, nullptr, gate_up, dim, gate_up_stride, j);
    });

    region.for_static(live, [&](int64_t b) {
      const float *g = gate_up + b * gate_up_stride;
      rowwise::swiglu(g, g + ffn, ffn, act + b * ffn);
    });

    quantize(region, act, ffn);
    region.for_dynamic(dim / TILE, 2, [&](int64_t j) { product(3, w_down, act, x1, out, ffn, dim, j); });
  });
  return 0;
}

bool valid(int *ndims) { return ndims[0] == 2 && ndims[6] == 2 && ndims[10] == 3 && ndims[13] == 3; }

}  // namespace

extern "C" int FusedLayer(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes,
                          void *stream, void *extra) {
  (void)stream; (void)extra; (void)dtypes;
  Paging paging;
  if (nparam != 19 || !valid(ndims) || !read_paging(params, ndims, shapes, 15, paging)) return 1;
  const uint8_t *const none[4] = {nullptr, nullptr, nullptr, nullptr};
  return run_layer(params, shapes, none, false, paging, static_cast<float *>(params[18]));
}

namespace {

// FusedLayerQ4's call on its 23 params (output at 22); int8: FusedLayerQ4I8's.
int run_layer_q4(void **params, int *ndims, int64_t **shapes, bool int8) {
  Paging paging;
  if (ndims[0] != 2 || ndims[6] != 2 || !read_paging(params, ndims, shapes, 19, paging)) return 1;
  const int slots[4] = {2, 10, 12, 13};  // where run_layer reads each product's [N / TILE, K, TILE]
  int64_t dims[4][3];
  int64_t *patched[23];
  std::copy(shapes, shapes + 23, patched);
  const uint8_t *q4w[4];
  for (int i = 0; i < 4; ++i) {
    const int64_t *shape = shapes[15 + i];
    if (ndims[15 + i] != 3 || shape[0] <= 0 || shape[1] <= 0 || shape[2] != q4::TILE_BYTES) return 1;
    dims[i][0] = shape[0], dims[i][1] = shape[1] * q4::BLOCK, dims[i][2] = TILE;
    patched[slots[i]] = dims[i];
    q4w[i] = static_cast<const uint8_t *>(params[15 + i]);
  }
  return run_layer(params, patched, q4w, int8, paging, static_cast<float *>(params[22]));
}

}  // namespace

// The same with the Q4_1 copies as inputs 15-18 (wqkv, wo, w_gate_up, w_down; each
// [N / TILE, K / 32, q4::TILE_BYTES] uint8); tables, row_table and block_size 19-21; output 22.
// Inputs 2, 10, 12 and 13 (the float32 weights) are not read: any placeholder will do; the
// products' shapes come from the Q4_1 copies (run_layer checks them against each other).
extern "C" int FusedLayerQ4(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes,
                            void *stream, void *extra) {
  (void)stream; (void)extra; (void)dtypes;
  if (nparam != 23) return 1;
  return run_layer_q4(params, ndims, shapes, false);
}

// FusedLayerQ4 with the opt-in int8 products for calls of more than q4i8::ABOVE_ROWS rows.
extern "C" int FusedLayerQ4I8(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes,
                              void *stream, void *extra) {
  (void)stream; (void)extra; (void)dtypes;
  if (nparam != 23) return 1;
  return run_layer_q4(params, ndims, shapes, true);
}

namespace {

// Every layer of the model in one op: FusedLayerQ4 layer after layer, each layer's output the
// next one's input. One op a step instead of one a layer, each of whose launches MindSpore checked
// and counted 23 inputs: a decode step of 1 row 6.25 -> 5.95 ms, of 16 rows 32.0 -> 30.7 ms
// (tools.model_bench, context 160, medians of 6 alternating processes, the 2-core EPYC).
//   0 x [N, D]   1 cos   2 sin   3 write [N KV]   4 len [N KV]   5 eps [1]   6 tables   7 row_table
//   8 block_size (as FusedLayer's); then each layer's 9 inputs: attn_norm, bqkv, k_cache, v_cache,
//   ffn_norm and the Q4_1 wqkv, wo, w_gate_up, w_down; output [N, D] last.
int run_stack_q4(int nparam, void **params, int *ndims, int64_t **shapes, bool int8) {
  constexpr int COMMON = 9, PER_LAYER = 9;
  if (nparam < COMMON + PER_LAYER + 1 || (nparam - COMMON - 1) % PER_LAYER != 0 || ndims[0] != 2) return 1;
  const int layers = (nparam - COMMON - 1) / PER_LAYER;
  const int64_t rows = shapes[0][0], dim = shapes[0][1];
  float *out = static_cast<float *>(params[nparam - 1]);
  // Layers alternate between out and this buffer so that the last one writes out.
  thread_local std::vector<float> other_buf;
  other_buf.resize(rows * dim);
  static float placeholder = 0.0f;
  static int64_t one[1] = {1};
  void *p[23];
  int nd[23];
  int64_t *sh[23];
  const int common_at[9][2] = {{4, 1}, {5, 2}, {8, 3}, {9, 4}, {14, 5}, {19, 6}, {20, 7}, {21, 8}, {0, 0}};
  for (const auto &c : common_at) p[c[0]] = params[c[1]], nd[c[0]] = ndims[c[1]], sh[c[0]] = shapes[c[1]];
  for (int fp32 : {2, 10, 12, 13}) p[fp32] = &placeholder, nd[fp32] = 1, sh[fp32] = one;
  const int own_at[9] = {1, 3, 6, 7, 11, 15, 16, 17, 18};  // the layer's inputs in FusedLayerQ4's order
  for (int layer = 0; layer < layers; ++layer) {
    const int first = COMMON + layer * PER_LAYER;
    for (int i = 0; i < PER_LAYER; ++i)
      p[own_at[i]] = params[first + i], nd[own_at[i]] = ndims[first + i], sh[own_at[i]] = shapes[first + i];
    float *to = (layers - 1 - layer) % 2 == 0 ? out : other_buf.data();
    if (layer > 0) p[0] = (layers - layer) % 2 == 0 ? out : other_buf.data();
    p[22] = to;
    const int failed = run_layer_q4(p, nd, sh, int8);
    if (failed) return failed;
  }
  return 0;
}

}  // namespace

extern "C" int FusedStackQ4(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes,
                            void *stream, void *extra) {
  (void)stream; (void)extra; (void)dtypes;
  return run_stack_q4(nparam, params, ndims, shapes, false);
}

// FusedStackQ4 with the opt-in int8 products for calls of more than q4i8::ABOVE_ROWS rows.
extern "C" int FusedStackQ4I8(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes,
                              void *stream, void *extra) {
  (void)stream; (void)extra; (void)dtypes;
  return run_stack_q4(nparam, params, ndims, shapes, true);
}
