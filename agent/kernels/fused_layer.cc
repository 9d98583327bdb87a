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
//   13 state_slots [T, 5] int32: each table's state moves in the Gated DeltaNet layers (gated_delta.h;
//   [1], unread, in a model without them): its slot, the rows of the slot's last held run to replay
//   first, held (1: its rows run on a copy of the state and are kept for a replay), the slot to
//   restore its state from before its rows (-1: none; any other slot, copied before any run of the
//   call changes a state), the snapshot slot to save it into after them (-1: none)
//   then each layer's 18 inputs: attn_norm [D], bqkv [(H + 2 KV) hd], k_cache [R, hd], v_cache
//   [R, hd] (paged, R = blocks * KV * B: position p of KV head h of a sequence with block table T
//   is row (T[p / B] * KV + h) * B + p % B, row_ops.h Paged; or uint8 [R, hd / 32 * 34], a q8_0
//   cache: kv_rows.h), ffn_norm [D], formats [7] int32 (the
//   format of each matrix, product.h), wq, wk, wv, wo, w_gate, w_up, w_down (rows as output columns,
//   packed: product.h read_matrix), q_norm [hd], k_norm [hd], post_attn_norm [D], post_ffn_norm [D]
//   (each [1] and unread where the layer has none), options [9] int32: the sliding window (0: none,
//   else the positions a row attends, its own included), local (1: inputs 9-12), the activation
//   (0 SwiGLU, 1 GeGLU with tanh GELU), QK-norm (1: each query and key head RMS-normed by q_norm,
//   k_norm before RoPE), post-norms (1: the attention's and the FFN's outputs RMS-normed by
//   post_attn_norm, post_ffn_norm before their residual adds: Gemma's four norms a layer), the head
//   size (0: the RoPE tables' width; else RoPE rotates the tables' width of each head and leaves
//   the rest: Qwen3.5's partial RoPE), the output gate (1: wq's product holds each query head
//   [hd] followed by its gate [hd], and the head's output is multiplied by sigmoid(gate)), the
//   kind (0 attention; 1 a Gated DeltaNet layer, gated_delta.h, whose 18 inputs are: attn_norm,
//   held [L, R (C + 2 value_heads)] (each live slot's last held rows' conv inputs, b and a: R rows,
//   0 where it is narrower), conv_state [S, (K - 1) C] and recurrent_state [S, value_heads * key_dim
//   * value_dim] (float32, written in place; L live slots, then snapshot slots up to S),
//   ffn_norm, formats, wq: the QKV product
//   (C = 2 key_heads key_dim + value_heads value_dim columns), wk: z [value_heads value_dim], wv:
//   b then a [2 value_heads], wo: the output product, w_gate, w_up, w_down, norm [value_dim],
//   conv [K * C] (tap-major), dt_bias [value_heads], A [value_heads] (-exp(A_log)), options; its shape is
//   read from theirs), bidirectional (1: each row also attends its sequence's later positions in
//   the call, prompt_attention.h bidirectional_span: an encoder's, whose prompts run whole);
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
#include "gated_delta.h"
#include "int8_products.h"
#include "product.h"
#include "prompt_attention.h"
#include "row_ops.h"
#include "thread_team.h"

namespace {

using packed::TILE;

constexpr int64_t MAX_HEAD_DIM = 512;  // one head's bias-added row lives on the stack
constexpr int COMMON = 14, PER_LAYER = 18, MATRICES = 7, OPTIONS = 9;
enum { MOVE_SLOT, MOVE_REPLAY, MOVE_HOLD, MOVE_RESTORE, MOVE_SAVE, STATE_MOVES };
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

// The inputs every layer of a call shares (0-13).
struct Step {
  Positions global, local;
  const int32_t *len;
  const int32_t *state_moves;  // each table's STATE_MOVES (Gated DeltaNet layers)
  int64_t state_tables;
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
  int64_t rotary = 0;  // the dims of each head RoPE rotates (the tables' width), the rest as they are
  bool local = false, geglu = false;
  bool bidirectional = false;  // rows attend their sequence's later positions in the call too (encoders)
  bool gated = false;  // the queries' product holds each head's output gate after it
  product::Matrix m[MATRICES];
  // A Gated DeltaNet layer (gated_delta.h) in place of attention: its shape, weights and state
  bool delta = false;
  gated_delta::Shape shape;
  const float *conv_weight = nullptr, *dt_bias = nullptr, *a_neg = nullptr, *delta_norm = nullptr;
  float *conv_state = nullptr, *recurrent_state = nullptr, *held = nullptr;
  int64_t state_slots = 0, live_slots = 0, held_rows = 0;  // held_rows: R

  int64_t held_width() const { return shape.channels() + 2 * shape.value_heads; }
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
  if (ndims[13] == 2 && shapes[13][1] != STATE_MOVES) return false;
  step.state_moves = static_cast<const int32_t *>(params[13]);
  step.state_tables = ndims[13] == 2 ? shapes[13][0] : 0;
  return read_positions(params, ndims, shapes, 1, 2, 3, 6, step.global) &&
         read_positions(params, ndims, shapes, 9, 10, 11, 12, step.local) && step.global.paging.block > 0 &&
         step.kv > 0;
}

// A Gated DeltaNet layer's own inputs from `at` (the interface's second list): its shape from theirs.
bool read_delta_layer(void **params, int *ndims, int64_t **shapes, int at, const Step &step, Layer &layer) {
  if (ndims[at + 1] != 2 || ndims[at + 2] != 2 || ndims[at + 3] != 2 || shapes[at + 2][0] != shapes[at + 3][0] ||
      shapes[at + 1][0] > shapes[at + 2][0])
    return false;
  gated_delta::Shape &shape = layer.shape;
  shape.value_heads = shapes[at + 15][0], shape.value_dim = shapes[at + 13][0];
  const int64_t conv_held = shapes[at + 2][1], channels = shapes[at + 14][0] - conv_held;
  if (shape.value_heads <= 0 || shape.value_dim <= 0 || shapes[at + 16][0] != shape.value_heads ||
      channels <= 0 || conv_held % channels != 0 || shapes[at + 3][1] % (shape.value_heads * shape.value_dim) != 0)
    return false;
  shape.conv_kernel = conv_held / channels + 1;
  shape.key_dim = shapes[at + 3][1] / (shape.value_heads * shape.value_dim);
  const int64_t key_part = channels - shape.value_width();
  if (shape.key_dim <= 0 || key_part <= 0 || key_part % (2 * shape.key_dim) != 0) return false;
  shape.key_heads = key_part / (2 * shape.key_dim);
  layer.delta = true;
  layer.conv_state = static_cast<float *>(params[at + 2]);
  layer.recurrent_state = static_cast<float *>(params[at + 3]);
  layer.state_slots = shapes[at + 2][0], layer.live_slots = shapes[at + 1][0];
  layer.held = static_cast<float *>(params[at + 1]);
  layer.held_rows = shapes[at + 1][1] / layer.held_width();
  layer.delta_norm = static_cast<const float *>(params[at + 13]);
  layer.conv_weight = static_cast<const float *>(params[at + 14]);
  layer.dt_bias = static_cast<const float *>(params[at + 15]);
  layer.a_neg = static_cast<const float *>(params[at + 16]);
  const product::Matrix *m = layer.m;
  const int64_t ffn = m[W_DOWN].k_dim;
  return shape.conv_kernel >= 2 && shape.conv_kernel <= 8 && shape.key_dim <= 512 && shape.value_dim <= 512 &&
         shape.value_heads % shape.key_heads == 0 && step.dim % TILE == 0 && m[WQ].n_dim() == padded(channels) &&
         m[WK].n_dim() == padded(shape.value_width()) && m[WV].n_dim() == padded(2 * shape.value_heads) &&
         m[WQ].k_dim == step.dim && m[WK].k_dim == step.dim && m[WV].k_dim == step.dim &&
         m[WO].k_dim == shape.value_width() && m[WO].n_dim() == step.dim && m[W_GATE].k_dim == step.dim &&
         m[W_UP].k_dim == step.dim && m[W_GATE].n_dim() == padded(ffn) && m[W_UP].n_dim() == padded(ffn) &&
         m[W_DOWN].n_dim() == step.dim;
}

// Layer inputs at `first` (the 18 of the interface); false where they do not fit each other or the step.
bool read_layer(void **params, int *ndims, int64_t **shapes, int first, const Step &step, Layer &layer) {
  const int at = first;
  if (ndims[at] != 1 || ndims[at + 4] != 1 || ndims[at + 5] != 1 ||
      shapes[at + 5][0] != MATRICES || shapes[at][0] != step.dim || shapes[at + 4][0] != step.dim ||
      ndims[at + 17] != 1 || shapes[at + 17][0] != OPTIONS)
    return false;
  for (int i = 13; i < 17; ++i)
    if (ndims[at + i] != 1) return false;
  const int32_t *options = static_cast<const int32_t *>(params[at + 17]);
  layer.window = options[0], layer.local = options[1] != 0, layer.geglu = options[2] != 0;
  const bool qk_norm = options[3] != 0, post_norms = options[4] != 0;
  layer.gated = options[6] != 0, layer.bidirectional = options[8] != 0;
  if (layer.window < 0 || options[2] < 0 || options[2] > 1 || options[5] < 0 || options[7] < 0 || options[7] > 1 ||
      options[8] < 0 || options[8] > 1 || (options[8] == 1 && options[7] == 1))
    return false;
  const int32_t *formats = static_cast<const int32_t *>(params[at + 5]);
  for (int i = 0; i < MATRICES; ++i)
    if (!product::read_matrix(params[at + 6 + i], formats[i], ndims[at + 6 + i], shapes[at + 6 + i], layer.m[i]))
      return false;
  layer.attn_norm = static_cast<const float *>(params[at]);
  layer.ffn_norm = static_cast<const float *>(params[at + 4]);
  if (post_norms) {
    if (shapes[at + 15][0] != step.dim || shapes[at + 16][0] != step.dim || options[7] == 1) return false;
    layer.post_attn_norm = static_cast<const float *>(params[at + 15]);
    layer.post_ffn_norm = static_cast<const float *>(params[at + 16]);
  }
  if (options[7] == 1) return read_delta_layer(params, ndims, shapes, at, step, layer);
  if (ndims[at + 1] != 1 || ndims[at + 2] != 2 || ndims[at + 3] != 2) return false;
  layer.rotary = shapes[layer.local ? 9 : 1][2];  // the RoPE tables'
  const int64_t head_dim = options[5] > 0 ? options[5] : layer.rotary;
  if (layer.rotary > head_dim || layer.rotary % 2 != 0) return false;
  if (qk_norm) {
    if (shapes[at + 13][0] != head_dim || shapes[at + 14][0] != head_dim) return false;
    layer.q_norm = static_cast<const float *>(params[at + 13]);
    layer.k_norm = static_cast<const float *>(params[at + 14]);
  }
  layer.bqkv = static_cast<const float *>(params[at + 1]);
  if (!kvrows::Cache::of(params[at + 2], shapes[at + 2][1], head_dim, layer.k_cache) ||
      !kvrows::Cache::of(params[at + 3], shapes[at + 3][1], head_dim, layer.v_cache) ||
      shapes[at + 3][1] != shapes[at + 2][1])
    return false;
  layer.cache_rows = shapes[at + 2][0], layer.hd = head_dim, layer.bias = shapes[at + 1][0];
  const int64_t hd = layer.hd, kv_width = step.kv * hd, q_width = layer.bias - 2 * kv_width;
  const product::Matrix *m = layer.m;
  const int64_t ffn = m[W_DOWN].k_dim;
  return shapes[at + 3][0] == layer.cache_rows && hd <= MAX_HEAD_DIM &&
         q_width > 0 && q_width % (step.kv * hd) == 0 && step.dim % TILE == 0 &&
         m[WQ].n_dim() == padded(q_width * (layer.gated ? 2 : 1)) && m[WK].n_dim() == padded(kv_width) &&
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

// A sequence's rows of a call (consecutive rows of one table) in a Gated DeltaNet layer.
struct Run {
  int64_t first, rows;
  int32_t slot;     // its state slot
  bool fresh;       // its first row is its position 0: the state starts from zeros
  int32_t replay;   // rows of the slot's last held run applied first
  bool hold;        // its rows run on a copy of the state, kept for a replay
  int32_t restore;  // the slot its state starts from (-1: none)
  int32_t save;     // the snapshot slot its state is saved into (-1: none)
  int64_t replayed; // where its replayed rows' conv outputs start in the replay buffer
};

// The live rows as runs of one table each with their state moves; false where a table's rows are
// not consecutive, a table's moves do not fit the layer's slots (or each other), or two runs share a
// slot. `replayed`: the replayed rows of all runs.
bool find_runs(const Step &step, const Layer &layer, int64_t live, std::vector<Run> &runs, int64_t &replayed) {
  const int32_t *row_table = step.global.paging.row_table;
  runs.clear();
  replayed = 0;
  for (int64_t row = 0; row < live; ++row) {
    if (!runs.empty() && row_table[row] == row_table[runs.back().first]) {
      ++runs.back().rows;
      continue;
    }
    const int32_t table = row_table[row];
    if (table < 0 || table >= step.state_tables) return false;
    const int32_t *moves = step.state_moves + table * STATE_MOVES;
    const Run run{row, 1, moves[MOVE_SLOT], step.len[row * step.kv] == 1, moves[MOVE_REPLAY],
                  moves[MOVE_HOLD] != 0, moves[MOVE_RESTORE], moves[MOVE_SAVE], replayed};
    const bool saves = run.save == -1 || (run.save >= layer.live_slots && run.save < layer.state_slots);
    if (run.slot < 0 || run.slot >= layer.live_slots || run.replay < 0 || run.replay > layer.held_rows ||
        run.restore < -1 || run.restore >= layer.state_slots || run.restore == run.slot || !saves ||
        (run.hold && run.save != -1) ||
        (run.restore != -1 && (run.fresh || run.replay > 0)) || (run.fresh && run.replay > 0))
      return false;
    for (const Run &other : runs)
      if (row_table[other.first] == table || other.slot == run.slot) return false;
    replayed += run.replay;
    runs.push_back(run);
  }
  for (const Run &run : runs) {
    if (run.hold && run.rows > layer.held_rows) return false;
    for (const Run &other : runs)
      if (run.save != -1 && run.save == other.save && &run != &other) return false;
  }
  return true;
}

int run_layer(const float *x, const Step &step, const Layer &layer, bool int8_activations, float *out) {
  const int64_t batch = step.batch, dim = step.dim, kv = step.kv, hd = layer.hd;
  const product::Matrix *m = layer.m;
  const int64_t ffn = m[W_DOWN].k_dim;
  // the attention's query width (and output's), or the Gated DeltaNet's output width
  const int64_t q_width = layer.delta ? layer.shape.value_width() : layer.bias - 2 * kv * hd;
  const int64_t heads = layer.delta ? 0 : q_width / hd, groups = layer.delta ? 0 : heads / kv;
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
  thread_local std::vector<Run> runs_buf;
  std::vector<Run> &runs = runs_buf;
  int64_t replayed = 0;
  if (layer.delta) {
    if (!find_runs(step, layer, live, runs, replayed)) return 1;
  } else {
    const int64_t cache_rows = layer.cache_rows, blocks = cache_rows / (kv * paging.block);
    if (cache_rows % (kv * paging.block) != 0) return 1;
    for (int64_t n = 0; n < live * kv; ++n) {  // every block read and row written lies in the cache
      const int32_t table_row = paging.row_table[n / kv];
      if (table_row < 0 || table_row >= paging.table_rows || write[n] < 0 || write[n] >= cache_rows ||
          !rowwise::table_covers(paging.table(n / kv), paging.entries, paging.block, len[n], blocks))
        return 1;
    }
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
  thread_local std::vector<float> qkv_buf, q_buf, attn_buf, x1_buf, gate_up_buf, act_buf, post_buf, conv_buf,
      replay_buf;
  qkv_buf.resize(batch * qkv_stride);
  q_buf.resize(layer.delta ? 0 : batch * q_width);
  conv_buf.resize(layer.delta ? batch * layer.shape.channels() : 0);
  replay_buf.resize(layer.delta ? replayed * layer.shape.channels() : 0);
  attn_buf.resize(batch * q_width);
  x1_buf.resize(batch * dim);
  gate_up_buf.resize(batch * gate_up_stride);
  act_buf.resize(batch * ffn);
  const bool post_norms = layer.post_attn_norm != nullptr;
  if (post_norms) post_buf.resize(batch * dim);  // wo's and w_down's products before their norms
  float *qkv = qkv_buf.data(), *q = q_buf.data(), *attn = attn_buf.data(), *x1 = x1_buf.data();
  float *gate_up = gate_up_buf.data(), *act = act_buf.data(), *post = post_buf.data(), *conv = conv_buf.data();
  float *replay_conv = replay_buf.data();

  // Attention's work items: blocks of rows sharing a table (prompt_attention.h), per KV head.
  const std::vector<prompt_attention::Block> blocks_todo =
      layer.delta ? std::vector<prompt_attention::Block>()
                  : prompt_attention::find_blocks(paging.row_table, live, kv, groups, team::Team::instance().size());
  const int64_t n_attend = static_cast<int64_t>(blocks_todo.size());
  // The Gated DeltaNet's: the conv's channels of each run in chunks, then each run's value heads.
  constexpr int64_t CONV_CHUNK = 64;
  const gated_delta::Shape &shape = layer.shape;
  const int64_t channels = shape.channels(), conv_chunks = (channels + CONV_CHUNK - 1) / CONV_CHUNK;
  const int64_t n_runs = static_cast<int64_t>(runs.size());

  const float *bqkv = layer.bqkv;
  const int64_t rotary = layer.rotary, q_stride = layer.gated ? 2 * hd : hd;
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

    if (layer.delta) {
      // Each run's state moves (gated_delta.h): a snapshot restored into its slot; then the conv
      // over the held rows it replays and its own rows; then each value head's recurrence over
      // them; then its state saved into a snapshot.
      const int64_t conv_held = shape.conv_state(), head_state = shape.head_state(), width = layer.held_width();
      const int64_t slot_state = shape.value_heads * head_state;
      auto copy_state = [&](int64_t to, int64_t from) {  // a slot's whole state into another slot
        std::memcpy(layer.conv_state + to * conv_held, layer.conv_state + from * conv_held, sizeof(float) * conv_held);
        std::memcpy(layer.recurrent_state + to * slot_state, layer.recurrent_state + from * slot_state,
                    sizeof(float) * slot_state);
      };
      region.for_dynamic(n_runs, 1, [&](int64_t i) {
        if (runs[i].restore >= 0) copy_state(runs[i].slot, runs[i].restore);
      });
      region.for_dynamic(n_runs * conv_chunks, 1, [&](int64_t i) {
        const Run &run = runs[i / conv_chunks];
        const int64_t c0 = (i % conv_chunks) * CONV_CHUNK, c1 = std::min(channels, c0 + CONV_CHUNK);
        float *state = layer.conv_state + run.slot * conv_held, *held = layer.held + run.slot * layer.held_rows * width;
        if (run.replay > 0)
          gated_delta::convolve(shape, layer.conv_weight, state, false, true, held, width, run.replay,
                                replay_conv + run.replayed * channels, channels, c0, c1);
        const float *in = qkv + run.first * qkv_stride;
        gated_delta::convolve(shape, layer.conv_weight, state, run.fresh, !run.hold, in, qkv_stride, run.rows,
                              conv + run.first * channels, channels, c0, c1);
        if (run.hold)  // the rows' conv inputs, for a replay
          for (int64_t r = 0; r < run.rows; ++r)
            std::memcpy(held + r * width + c0, in + r * qkv_stride + c0, sizeof(float) * (c1 - c0));
      });
      region.for_dynamic(n_runs * shape.value_heads, 1, [&](int64_t i) {
        const Run &run = runs[i / shape.value_heads];
        const int64_t head = i % shape.value_heads;
        float *state = layer.recurrent_state + (run.slot * shape.value_heads + head) * head_state;
        float *held = layer.held + run.slot * layer.held_rows * width;
        if (run.replay > 0) {
          const gated_delta::HeadInputs replay{replay_conv + run.replayed * channels,
                                               nullptr,
                                               held + channels,
                                               channels,
                                               width,
                                               layer.dt_bias,
                                               layer.a_neg,
                                               layer.delta_norm,
                                               step.eps};
          gated_delta::recur(shape, replay, head, state, false, run.replay, nullptr, 0);
        }
        const float *ba = qkv + run.first * qkv_stride + v_column;
        const gated_delta::HeadInputs in{conv + run.first * channels,
                                         qkv + run.first * qkv_stride + k_column,
                                         ba,
                                         channels,
                                         qkv_stride,
                                         layer.dt_bias,
                                         layer.a_neg,
                                         layer.delta_norm,
                                         step.eps};
        thread_local std::vector<float> copy;
        if (run.hold) {  // a copy of the state, and the rows' b and a kept for a replay
          copy.assign(state, state + head_state);
          state = copy.data();
          for (int64_t r = 0; r < run.rows; ++r) {
            held[r * width + channels + head] = ba[r * qkv_stride + head];
            held[r * width + channels + shape.value_heads + head] = ba[r * qkv_stride + shape.value_heads + head];
          }
        }
        gated_delta::recur(shape, in, head, state, run.fresh, run.rows, attn + run.first * q_width, q_width);
      });
      region.for_dynamic(n_runs, 1, [&](int64_t i) {
        if (runs[i].save >= 0) copy_state(runs[i].save, runs[i].slot);
      });
    } else {
      // Per (row, KV head): bias, RoPE of its query heads (scaled) and key, K/V into the cache; then,
      // once all are written (a prompt's rows attend to each other's), attention. With QK-norm each
      // query and key head is RMS-normed before its RoPE; RoPE rotates the first `rotary` dims.
      const float *q_norm = layer.q_norm, *k_norm = layer.k_norm;
      region.for_static(live_rows, [&](int64_t n) {
        const int64_t b = n / kv, head = n % kv;
        const float *row = qkv + b * qkv_stride, *c = at_positions.cos + b * rotary;
        const float *s = at_positions.sin + b * rotary;
        float biased[MAX_HEAD_DIM];
        for (int64_t g = 0; g < groups; ++g) {
          const int64_t at = (head * groups + g) * hd;
          const float *query = row + (head * groups + g) * q_stride;
          for (int64_t d = 0; d < hd; ++d) biased[d] = query[d] + bqkv[at + d];
          if (q_norm != nullptr) rowwise::rms_norm(biased, q_norm, step.eps, hd, biased);
          for (int64_t d = 0; d < hd; ++d) biased[d] *= scale;
          float *to = q + (n * groups + g) * hd;
          rowwise::rope(biased, c, s, rotary, to);
          std::memcpy(to + rotary, biased + rotary, sizeof(float) * (hd - rotary));
        }
        const int64_t k_at = k_column + head * hd, v_at = v_column + head * hd;
        const int64_t k_bias = q_width + head * hd, v_bias = q_width + (kv + head) * hd;
        for (int64_t d = 0; d < hd; ++d) biased[d] = row[k_at + d] + bqkv[k_bias + d];
        if (k_norm != nullptr) rowwise::rms_norm(biased, k_norm, step.eps, hd, biased);
        float roped[MAX_HEAD_DIM];
        rowwise::rope(biased, c, s, rotary, roped);
        std::memcpy(roped + rotary, biased + rotary, sizeof(float) * (hd - rotary));
        kvrows::store(k_cache, write[n], roped, hd);
        for (int64_t d = 0; d < hd; ++d) biased[d] = row[v_at + d] + bqkv[v_bias + d];
        kvrows::store(v_cache, write[n], biased, hd);
      });
      region.for_dynamic(n_attend, 1, [&](int64_t i) {
        const prompt_attention::Block &w = blocks_todo[i];
        const rowwise::Paged at{paging.table(w.b0), kv, paging.block, w.head};
        prompt_attention::attend_block(w, at, k_cache, v_cache, q, len, kv, groups, hd, window,
                                      layer.bidirectional, attn);
      });
      if (layer.gated)  // each head's output times sigmoid of its gate (Qwen3.5's gated attention)
        region.for_static(live, [&](int64_t b) {
          for (int64_t head = 0; head < heads; ++head) {
            const float *gate = qkv + b * qkv_stride + head * q_stride + hd;
            float *o = attn + b * q_width + head * hd;
            for (int64_t d = 0; d < hd; ++d) o[d] /= 1.f + std::exp(-gate[d]);
          }
        });
    }

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
