// A mixture-of-experts FFN (Qwen3-MoE's, Qwen3.5-MoE's) as one op, reading only the experts its rows choose:
// RMSNorm, the router's product, softmax over the experts, the top k (ties: the lower index), their
// weights renormalised to sum to 1 where asked; then rows grouped by expert, one product per used
// expert over its rows (gate, up, SwiGLU, down, in the experts' own weight format: product.h), and
// each row's experts' outputs summed in expert order, weighted, onto its residual.
//
// MindSpore AOT custom-op interface (CPU), float32 unless said:
//   0 x [N, D]: the layer's residual stream after attention
//   1 len [N KV] int32: as the fused layer's (fused_layer.cc): rows whose len is 0 are padding, all
//     at the end: nothing is computed for them and their output is their input
//   2 eps [1] or more: the RMSNorm's epsilon first   3 ffn_norm [D]
//   4 router: [E, D] packed (product.h read_matrix, E output columns padded to whole tiles)
//   5 gate, 6 up: [E, Fe columns as tiles, ...]: expert e's packed matrix at [e] (read_matrix's 3-D
//     shape behind the expert axis), 7 down: [E, D columns as tiles, ...] likewise
//   8 formats [4] int32: the format of the router, gate, up and down (every expert's the same)
//   9 options [2] int32: k (experts a row uses, 1..E), normalise (1: the k weights sum to 1)
//   with a shared expert (Qwen3.5-MoE's, which every row runs beside its k, weighted by
//   sigmoid(norm(x) . shared_gate)), four inputs more and formats [7] (then the shared gate's, up's
//   and down's):
//   10 shared_gate [D]   11 gate, 12 up [Fe columns as tiles, ...], 13 down: the shared expert's
//     packed matrices, of the routed experts' FFN size (its rows are one more expert's in every stage)
//   output [N, D] last.
// MoeFfnI8 (runtime.activations int8, as FusedStackI8): the experts' products in an integer format
// take their inputs quantized per block of 32 (int8_products.h, each slot's row quantized alone, so
// that an expert's row result is the same at every count of rows it gets); F16 and BF16 experts stay
// float32 products, as in the dense layers. The router stays float32: it is small (E columns) and its
// logits decide the routing, which int8 rounding would move between near-equal experts.
// The products run on the kernels' thread team (thread_team.h): each stage (gather, gate and up, SwiGLU,
// down, the weighted sums) one loop over every used expert's column tiles or rows, so a step wakes
// the team twice and waits at a handful of barriers however many experts its rows use.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "entry.h"
#include "int8_products.h"
#include "product.h"
#include "row_ops.h"
#include "thread_team.h"

namespace {

using packed::TILE;

constexpr int INPUTS = 10, SHARED_INPUTS = 4;
enum { ROUTER, GATE, UP, DOWN, SHARED_GATE_UP = 4, SHARED_DOWN = 6 };

// Expert `e`'s matrix of a stacked input [E, ...]: its 3-D shape behind the expert axis.
bool read_expert(void *w, int32_t format, int ndim, const int64_t *shape, int64_t e, product::Matrix &m) {
  if (ndim != 4 || e < 0 || e >= shape[0]) return false;
  const int64_t element = format == product::F32 ? 4 : 1;
  const int64_t bytes = shape[1] * shape[2] * shape[3] * element;
  return product::read_matrix(static_cast<const uint8_t *>(w) + e * bytes, format, 3, shape + 1, m);
}

// Whether a format's products take int8 activations (int8_products.h Traits: not F32, F16, BF16).
bool takes_int8(int32_t format) {
  bool usable = false;
  product::visit(format, [&](auto f) { usable = int8::Traits<decltype(f)>::USABLE; });
  return usable;
}

int run_moe(int nparam, void **params, int *ndims, int64_t **shapes, bool int8_activations) {
  const bool shared = nparam == INPUTS + SHARED_INPUTS + 1;
  if ((nparam != INPUTS + 1 && !shared) || ndims[0] != 2 || ndims[1] != 1 || ndims[2] != 1 || ndims[3] != 1 ||
      ndims[8] != 1 || ndims[9] != 1 || shapes[8][0] != (shared ? 7 : 4) || shapes[9][0] != 2 ||
      shapes[0][0] <= 0 || shapes[1][0] % shapes[0][0] != 0 || shapes[1][0] == 0)
    return 1;
  const int64_t batch = shapes[0][0], dim = shapes[0][1], kv = shapes[1][0] / batch;
  const int32_t *formats = static_cast<const int32_t *>(params[8]);
  const int32_t *options = static_cast<const int32_t *>(params[9]);
  const int64_t experts = shapes[5][0], top_k = options[0];
  const bool normalise = options[1] != 0;
  product::Matrix router, gate0, up0, down0;
  if (shapes[3][0] != dim || dim % TILE != 0 || top_k < 1 || top_k > experts || shapes[6][0] != experts ||
      shapes[7][0] != experts ||
      !product::read_matrix(params[4], formats[ROUTER], ndims[4], shapes[4], router) ||
      !read_expert(params[5], formats[GATE], ndims[5], shapes[5], 0, gate0) ||
      !read_expert(params[6], formats[UP], ndims[6], shapes[6], 0, up0) ||
      !read_expert(params[7], formats[DOWN], ndims[7], shapes[7], 0, down0))
    return 1;
  const int64_t ffn = down0.k_dim, ffn_stride = gate0.n_dim();
  if (router.k_dim != dim || router.n_dim() < experts || gate0.k_dim != dim || up0.k_dim != dim ||
      up0.n_dim() != ffn_stride || ffn_stride != (ffn + TILE - 1) / TILE * TILE || down0.n_dim() != dim)
    return 1;
  product::Matrix shared_gate, shared_up, shared_down;  // the shared expert's, where it has one
  if (shared && (ndims[10] != 1 || shapes[10][0] != dim ||
                 !product::read_matrix(params[11], formats[SHARED_GATE_UP], ndims[11], shapes[11], shared_gate) ||
                 !product::read_matrix(params[12], formats[SHARED_GATE_UP + 1], ndims[12], shapes[12], shared_up) ||
                 !product::read_matrix(params[13], formats[SHARED_DOWN], ndims[13], shapes[13], shared_down) ||
                 shared_gate.k_dim != dim || shared_up.k_dim != dim || shared_gate.n_dim() != ffn_stride ||
                 shared_up.n_dim() != ffn_stride || shared_down.k_dim != ffn || shared_down.n_dim() != dim))
    return 1;
  if (int8_activations && !int8::AVAILABLE) return 1;
  // Which products' inputs are quantized: an integer format's k_dim is whole blocks of 32 or 256.
  const bool int8_in = int8_activations && (takes_int8(formats[GATE]) || takes_int8(formats[UP]) ||
                                            (shared && (takes_int8(formats[SHARED_GATE_UP]) ||
                                                        takes_int8(formats[SHARED_GATE_UP + 1]))));
  const bool int8_act =
      int8_activations && (takes_int8(formats[DOWN]) || (shared && takes_int8(formats[SHARED_DOWN])));
  if ((int8_in && dim % int8::XBLOCK != 0) || (int8_act && ffn % int8::XBLOCK != 0)) return 1;

  const float *x = static_cast<const float *>(params[0]);
  const int32_t *len = static_cast<const int32_t *>(params[1]);
  const float eps = *static_cast<const float *>(params[2]);
  const float *norm = static_cast<const float *>(params[3]);
  const float *shared_weights = shared ? static_cast<const float *>(params[10]) : nullptr;
  float *out = static_cast<float *>(params[nparam - 1]);
  int64_t live = 0;  // rows before the padding
  while (live < batch && len[live * kv] > 0) ++live;
  std::memcpy(out + live * dim, x + live * dim, sizeof(float) * (batch - live) * dim);
  if (live == 0) return 0;

  // Routing: each row's k experts and weights.
  thread_local std::vector<float> h_buf, logits_buf, weight_buf, shared_buf;
  thread_local std::vector<int32_t> chosen_buf;
  const int64_t router_stride = router.n_dim();
  h_buf.resize(live * dim);
  logits_buf.resize(live * router_stride);
  weight_buf.resize(live * top_k);
  chosen_buf.resize(live * top_k);
  shared_buf.resize(live);
  float *h = h_buf.data(), *logits = logits_buf.data(), *weights = weight_buf.data();
  float *shared_weight = shared_buf.data();  // each row's sigmoid(h . shared_gate)
  int32_t *chosen = chosen_buf.data();
  team::Team::instance().run([&](team::Region &region) {
    region.for_static(live, [&](int64_t b) { rowwise::rms_norm(x + b * dim, norm, eps, dim, h + b * dim); });
    region.for_dynamic(router.tiles, 1, [&](int64_t j) {
      product::tile(router, h, nullptr, logits, live, router_stride, j);
    });
    region.for_static(live, [&](int64_t b) {
      float *row = logits + b * router_stride;  // softmax in place over the E experts
      const float top = *std::max_element(row, row + experts);
      float total = 0.f;
      for (int64_t e = 0; e < experts; ++e) total += row[e] = std::exp(row[e] - top);
      for (int64_t e = 0; e < experts; ++e) row[e] /= total;
      float kept = 0.f;
      for (int64_t i = 0; i < top_k; ++i) {
        int64_t best = -1;
        for (int64_t e = 0; e < experts; ++e)
          if (row[e] >= 0.f && (best < 0 || row[e] > row[best])) best = e;
        chosen[b * top_k + i] = static_cast<int32_t>(best);
        kept += weights[b * top_k + i] = row[best];
        row[best] = -1.f;  // taken
      }
      if (normalise)
        for (int64_t i = 0; i < top_k; ++i) weights[b * top_k + i] /= kept;
      if (shared) {
        float gate = 0.f;
        for (int64_t d = 0; d < dim; ++d) gate += h[b * dim + d] * shared_weights[d];
        shared_weight[b] = 1.f / (1.f + std::exp(-gate));
      }
    });
  });

  // Rows grouped by expert, in row order within each: slot s of the grouped order holds row
  // rows[s] for its expert; slots[b * k + i] are row b's slots in expert order. The shared expert's
  // slots follow the routed ones': routed + b is row b's.
  const int64_t routed = live * top_k, n_slots = routed + (shared ? live : 0);
  std::vector<int64_t> starts(experts + 1, 0), rows(n_slots), slots(routed);
  std::vector<float> slot_weights(n_slots);
  for (int64_t i = 0; i < routed; ++i) ++starts[chosen[i] + 1];
  for (int64_t e = 0; e < experts; ++e) starts[e + 1] += starts[e];
  std::vector<int64_t> at(starts.begin(), starts.end() - 1), filled(live, 0);
  for (int64_t e = 0; e < experts; ++e)  // in expert order, so each row's slots come out sorted
    for (int64_t i = 0; i < routed; ++i)
      if (chosen[i] == e) {
        const int64_t slot = at[e]++, b = i / top_k;
        rows[slot] = b, slot_weights[slot] = weights[i];
        slots[b * top_k + filled[b]++] = slot;
      }
  // The used experts' matrices, and every product's tiles as one list of jobs (expert, tile): each
  // stage is one loop over the team for all experts, not one per expert.
  struct Used { int64_t first, count; product::Matrix gate, up, down; };
  std::vector<Used> used;
  for (int64_t e = 0; e < experts; ++e) {
    if (starts[e + 1] == starts[e]) continue;  // an expert no row chose is never read
    Used u{starts[e], starts[e + 1] - starts[e], {}, {}, {}};
    read_expert(params[5], formats[GATE], ndims[5], shapes[5], e, u.gate);
    read_expert(params[6], formats[UP], ndims[6], shapes[6], e, u.up);
    read_expert(params[7], formats[DOWN], ndims[7], shapes[7], e, u.down);
    used.push_back(u);
  }
  if (shared) {
    for (int64_t b = 0; b < live; ++b) rows[routed + b] = b, slot_weights[routed + b] = shared_weight[b];
    used.push_back({routed, live, shared_gate, shared_up, shared_down});
  }
  struct Job { int64_t used, tile; bool up; };
  std::vector<Job> gate_up_jobs, down_jobs;
  for (int64_t i = 0; i < static_cast<int64_t>(used.size()); ++i) {
    for (int64_t j = 0; j < used[i].gate.tiles; ++j) gate_up_jobs.push_back({i, j, false});
    for (int64_t j = 0; j < used[i].up.tiles; ++j) gate_up_jobs.push_back({i, j, true});
    for (int64_t j = 0; j < used[i].down.tiles; ++j) down_jobs.push_back({i, j, false});
  }

  thread_local std::vector<float> xe_buf, gate_buf, up_buf, act_buf, y_buf;
  xe_buf.resize(n_slots * dim);
  gate_buf.resize(n_slots * ffn_stride);
  up_buf.resize(n_slots * ffn_stride);
  act_buf.resize(n_slots * ffn);
  y_buf.resize(n_slots * dim);
  float *xe = xe_buf.data(), *g = gate_buf.data(), *u = up_buf.data(), *act = act_buf.data(), *y = y_buf.data();
  // MoeFfnI8: each slot's expert input and SwiGLU output quantized (int8::Rows of k_dim per slot), as
  // they are written; an expert's rows are then its slots' run from e.first.
  thread_local std::vector<int8_t> xq_buf, aq_buf;
  thread_local std::vector<float> xd_buf, xs_buf, ad_buf, as_buf;
  if (int8_in) {
    xq_buf.resize(n_slots * dim);
    xd_buf.resize(n_slots * dim / int8::XBLOCK);
    xs_buf.resize(n_slots * dim / int8::XSUM);
  }
  if (int8_act) {
    aq_buf.resize(n_slots * ffn);
    ad_buf.resize(n_slots * ffn / int8::XBLOCK);
    as_buf.resize(n_slots * ffn / int8::XSUM);
  }
  // (addresses taken here: in the team's threads the thread_local names are other vectors)
  const int8::Rows xq{xq_buf.data(), xd_buf.data(), xs_buf.data(), dim};
  const int8::Rows aq{aq_buf.data(), ad_buf.data(), as_buf.data(), ffn};
  // Tile j of expert e's product over its rows (from slot e.first): int8 where `quantized` and its
  // format takes it, the quantized rows those of x from that slot on.
  auto expert_tile = [](const product::Matrix &w, const Used &e, bool quantized, const int8::Rows &x,
                        const float *in, float *to, int64_t stride, int64_t j) {
    const int64_t k = x.k_dim, first = e.first;
    if (!quantized || !int8::tile(w, {x.q + first * k, x.d + first * (k / int8::XBLOCK),
                                      x.s + first * (k / int8::XSUM), k},
                                  nullptr, to, e.count, stride, j))
      product::tile(w, in, nullptr, to, e.count, stride, j);
  };
  team::Team::instance().run([&](team::Region &region) {
    region.for_static(n_slots, [&](int64_t s) {
      std::memcpy(xe + s * dim, h + rows[s] * dim, sizeof(float) * dim);
      if (int8_in) int8::quantize_row(xq, xe, s);
    });
    region.for_dynamic(static_cast<int64_t>(gate_up_jobs.size()), 1, [&](int64_t i) {
      const Job &job = gate_up_jobs[i];
      const Used &e = used[job.used];
      const float *in = xe + e.first * dim;
      if (job.up)
        expert_tile(e.up, e, int8_in, xq, in, u + e.first * ffn_stride, ffn_stride, job.tile);
      else
        expert_tile(e.gate, e, int8_in, xq, in, g + e.first * ffn_stride, ffn_stride, job.tile);
    });
    region.for_static(n_slots, [&](int64_t s) {
      rowwise::swiglu(g + s * ffn_stride, u + s * ffn_stride, ffn, act + s * ffn);
      if (int8_act) int8::quantize_row(aq, act, s);
    });
    region.for_dynamic(static_cast<int64_t>(down_jobs.size()), 1, [&](int64_t i) {
      const Used &e = used[down_jobs[i].used];
      expert_tile(e.down, e, int8_act, aq, act + e.first * ffn, y + e.first * dim, dim, down_jobs[i].tile);
    });
    // each row: its experts' outputs summed in expert order, weighted, then the shared expert's,
    // then onto the residual
    region.for_static(live, [&](int64_t b) {
      float *to = out + b * dim;
      for (int64_t d = 0; d < dim; ++d) to[d] = 0.f;
      auto add = [&](int64_t slot) {
        const float w = slot_weights[slot];
        for (int64_t d = 0; d < dim; ++d) to[d] += w * y[slot * dim + d];
      };
      for (int64_t i = 0; i < top_k; ++i) add(slots[b * top_k + i]);
      if (shared) add(routed + b);
      for (int64_t d = 0; d < dim; ++d) to[d] += x[b * dim + d];
    });
  });
  return 0;
}

}  // namespace

KERNEL_ENTRY int MoeFfn(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes, void *stream,
                      void *extra) {
  (void)stream; (void)extra; (void)dtypes;
  return run_moe(nparam, params, ndims, shapes, false);
}

// MoeFfn with the opt-in int8 activations for the integer formats' experts.
KERNEL_ENTRY int MoeFfnI8(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes, void *stream,
                        void *extra) {
  (void)stream; (void)extra; (void)dtypes;
  return run_moe(nparam, params, ndims, shapes, true);
}
