// Per-row steps of a decoder layer, shared by elementwise.cc, decode_attention.cc and fused_layer.cc.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "vec8.h"

namespace rowwise {

// out[d] = x[d] / sqrt(mean(x^2) + eps) * w[d]
inline void rms_norm(const float *x, const float *w, float eps, int64_t dim, float *out) {
  float squares = 0.f;
#pragma omp simd reduction(+ : squares)
  for (int64_t d = 0; d < dim; ++d) squares += x[d] * x[d];
  const float scale = 1.f / std::sqrt(squares / static_cast<float>(dim) + eps);
#pragma omp simd
  for (int64_t d = 0; d < dim; ++d) out[d] = x[d] * scale * w[d];
}

// Rotate-half RoPE of one head: out = x * cos + concat(x2, x1) * sin, the sign folded into sin.
inline void rope(const float *x, const float *cos, const float *sin, int64_t hd, float *out) {
  const int64_t half = hd / 2;
#pragma omp simd
  for (int64_t d = 0; d < half; ++d) out[d] = x[d] * cos[d] + x[d + half] * sin[d];
#pragma omp simd
  for (int64_t d = half; d < hd; ++d) out[d] = x[d] * cos[d] + x[d - half] * sin[d];
}

using vec8::v8f;
using vec8::v8i;

// exp of eight floats (Cephes' expf: 2^n * a degree-6 polynomial of the remainder; about 1 ulp from
// std::exp). Softmax called the scalar std::exp for every score: a third of the attention's time.
inline v8f exp8(v8f x) {
  x = x < -87.3f ? -87.3f : x;  // below: denormal results, returned as exp(-87.3)
  x = x > 88.3762626f ? 88.3762626f : x;  // above: 2^n would overflow the exponent
  v8f n = x * 1.44269504088896341f + 0.5f;
  v8f whole = __builtin_convertvector(__builtin_convertvector(n, v8i), v8f);
  whole += __builtin_convertvector(whole > n, v8f);  // truncation -> floor (the mask is -1 where it rounded up)
  const v8f r = x - whole * 0.693359375f + whole * 2.12194440e-4f;
  v8f y = 1.9875691500E-4f * r + 1.3981999507E-3f;
  y = y * r + 8.3334519073E-3f;
  y = y * r + 4.1665795894E-2f;
  y = y * r + 1.6666665459E-1f;
  y = y * r + 5.0000001201E-1f;
  y = y * r * r + r + 1.f;
  const v8i scale = (__builtin_convertvector(whole, v8i) + 127) << 23;
  return y * (v8f)scale;
}

// out[f] = silu(gate[f]) * up[f], eight at a time through exp8: std::exp stays a scalar call in an
// `omp simd` loop (glibc's vector expf needs -ffast-math), 0.11 ms a layer at 16 rows against 0.02.
inline void swiglu(const float *gate, const float *up, int64_t width, float *out) {
  int64_t f = 0;
  for (; f + 8 <= width; f += 8) {
    const v8f g = vec8::load(gate + f);
    const v8f silu = g / (1.f + exp8(-g)) * vec8::load(up + f);
    std::memcpy(out + f, &silu, sizeof silu);
  }
  for (; f < width; ++f) out[f] = gate[f] / (1.f + std::exp(-gate[f])) * up[f];
}

// out[f] = gelu(gate[f]) * up[f] (GeGLU, Gemma's), GELU in its tanh form: 0.5 g (1 + tanh(u)) with
// u = sqrt(2 / pi) (g + 0.044715 g^3), which is g / (1 + exp(-2 u)): silu's form, eight at a time.
inline void geglu(const float *gate, const float *up, int64_t width, float *out) {
  constexpr float TWO_C = 2.f * 0.7978845608028654f, CUBE = 0.044715f;
  int64_t f = 0;
  for (; f + 8 <= width; f += 8) {
    const v8f g = vec8::load(gate + f);
    const v8f gelu = g / (1.f + exp8(-TWO_C * (g + CUBE * g * g * g))) * vec8::load(up + f);
    std::memcpy(out + f, &gelu, sizeof gelu);
  }
  for (; f < width; ++f) {
    const float g = gate[f];
    out[f] = g / (1.f + std::exp(-TWO_C * (g + CUBE * g * g * g))) * up[f];
  }
}

// A sequence's cached positions in a paged cache [blocks * kv * block, hd] (agent/graph_interface.py):
// position p of KV head `head` is row (table[p / block] * kv + head) * block + p % block, so each
// block holds `block` consecutive positions of one head in consecutive rows.
struct Paged {
  const int32_t *table;  // the sequence's blocks, position order
  int64_t kv, block, head;

  // The first row of the sequence's j-th block, in `cache`.
  const float *rows(const float *cache, int64_t j, int64_t hd) const {
    return cache + ((static_cast<int64_t>(table[j]) * kv + head) * block) * hd;
  }
};

// Whether the `entries` blocks of `table` hold `length` positions in a pool of `blocks` blocks.
inline bool table_covers(const int32_t *table, int64_t entries, int64_t block, int64_t length,
                         int64_t blocks) {
  if (length < 0 || length > entries * block) return false;
  for (int64_t j = 0; j * block < length; ++j)
    if (table[j] < 0 || table[j] >= blocks) return false;
  return true;
}

// scores[:length] <- softmax(scores[:length]); all zeros when length is 0. Max and sum eight lanes
// at a time: one scalar max after another is a chain of dependent instructions (a prompt chunk's
// attention spent half its time in that loop).
inline void softmax(float *s, int64_t length) {
  float best = -INFINITY;
  int64_t l = 0;
  if (length >= 8) {
    v8f top = vec8::load(s);
    for (l = 8; l + 8 <= length; l += 8) {
      const v8f v = vec8::load(s + l);
      top = v > top ? v : top;
    }
    for (int i = 0; i < 8; ++i) best = top[i] > best ? top[i] : best;
  }
  for (; l < length; ++l) best = s[l] > best ? s[l] : best;
  v8f totals = {};
  l = 0;
  for (; l + 8 <= length; l += 8) {
    const v8f e = exp8(vec8::load(s + l) - best);
    std::memcpy(s + l, &e, sizeof e);
    totals += e;
  }
  float total = vec8::sum(totals);
  for (; l < length; ++l) {
    s[l] = std::exp(s[l] - best);
    total += s[l];
  }
  const float inv = total > 0.f ? 1.f / total : 0.f;
#pragma omp simd
  for (int64_t i = 0; i < length; ++i) s[i] *= inv;
}

// Rows of a paged cache block to stream from memory while another is computed: into L2, a
// 64-byte line at a time (16 floats).
inline void prefetch_rows(const float *rows, int64_t from, int64_t to) {
  for (int64_t at = from; at < to; at += 16) __builtin_prefetch(rows + at, 0, 2);
}

// Attention of `groups` query heads [groups, hd] over the cached positions first .. length - 1 of one
// (sequence, KV head) in a paged cache: out [groups, hd] = softmax(q . K) . V; the scale is already
// in q. `first` > 0: a sliding-window layer's, whose blocks before it are not read at all. One pass
// over the blocks (flash decoding's online softmax): a block's keys are dotted with
// every query head while in L1, eight keys at a time; the weights are folded into running sums,
// rescaled when a block raises a head's maximum; then each value row is weighed for every head at
// once. The blocks two ahead stream into L2 a row with each value row: the hardware prefetchers stop
// at every jump to another block, and the old kernel (a scores pass, a softmax pass and a values
// pass per head, one block prefetched ahead into L1) waited on memory between blocks at 15 GB/s of
// the ~25 two threads stream. Measured (tools.model_bench, decode steps): 16 rows at context 1024
// 76.5 -> ~71 ms, 32 rows 155 -> 112 ms, 32 rows at context 200 74 -> 70 ms, 16 at 200 41.4 -> 39.1.
// G and HD fixed at compile time (the default model's 3 and 64) keep the sums in registers; others
// run the same loop on runtime sizes (any groups, any head dim: the columns past a multiple of 8 one
// at a time).
template <int64_t G, int64_t HD>
inline void attend_blocks(const float *q, const float *k_cache, const float *v_cache, const Paged &at,
                          int64_t length, int64_t first, int64_t groups_, int64_t hd_, float *out) {
  constexpr int64_t AHEAD = 2, QUERIES = 4;  // blocks prefetched ahead; query heads a key pass serves
  const int64_t groups = G ? G : groups_, hd = HD ? HD : hd_;
  const int64_t B = at.block, blocks = (length + B - 1) / B, vec_hd = hd / 8 * 8;
  thread_local std::vector<float> state;
  constexpr int64_t MAX_BLOCK = 256;  // config/schema.py block_size's bound
  alignas(32) float fixed[G * (HD + MAX_BLOCK + 2) + 1];
  float *acc = fixed;
  if (G == 0 || HD == 0 || B > MAX_BLOCK) {
    state.resize(groups * (hd + B + 2));
    acc = state.data();
  }
  std::fill(acc, acc + groups * (hd + B + 2), 0.f);
  float *weights = acc + groups * hd;  // [groups, hd], [groups, B]
  float *top = weights + groups * B, *total = top + groups;
  std::fill(top, top + groups, -INFINITY);
  for (int64_t j = first / B; j < blocks; ++j) {
    const int64_t skip = std::max<int64_t>(0, first - j * B);  // positions before `first`
    const float *keys = at.rows(k_cache, j, hd) + skip * hd, *values = at.rows(v_cache, j, hd) + skip * hd;
    const int64_t n = std::min(B, length - j * B) - skip;
    const float *next_k = nullptr, *next_v = nullptr;
    int64_t next_n = 0;
    if (j + AHEAD < blocks) {
      next_k = at.rows(k_cache, j + AHEAD, hd), next_v = at.rows(v_cache, j + AHEAD, hd);
      next_n = std::min(B, length - (j + AHEAD) * B);
    }
    for (int64_t g0 = 0; g0 < groups; g0 += QUERIES) {
      const int64_t gn = std::min(QUERIES, groups - g0);
      int64_t l = 0;
      for (; l + 8 <= n; l += 8) {
        v8f dots[QUERIES][8] = {};
        for (int64_t c = 0; c < vec_hd; c += 8)
          for (int k = 0; k < 8; ++k) {
            const v8f key = vec8::load(keys + (l + k) * hd + c);
            for (int64_t g = 0; g < gn; ++g) dots[g][k] += vec8::load(q + (g0 + g) * hd + c) * key;
          }
        for (int64_t g = 0; g < gn; ++g) {
          v8f s = vec8::sums(dots[g]);
          for (int k = 0; k < 8; ++k)
            for (int64_t d = vec_hd; d < hd; ++d) s[k] += q[(g0 + g) * hd + d] * keys[(l + k) * hd + d];
          std::memcpy(weights + (g0 + g) * B + l, &s, sizeof s);
        }
      }
      for (; l < n; ++l)
        for (int64_t g = g0; g < g0 + gn; ++g) {
          float s = 0.f;
          for (int64_t d = 0; d < hd; ++d) s += q[g * hd + d] * keys[l * hd + d];
          weights[g * B + l] = s;
        }
    }
    for (int64_t g = 0; g < groups; ++g) {
      float *w = weights + g * B;
      const float best = std::max(top[g], *std::max_element(w, w + n));
      const float rescale = std::exp(top[g] - best);  // 0 on the first block (top is -inf)
      top[g] = best;
      v8f sums = {};
      int64_t l = 0;
      for (; l + 8 <= n; l += 8) {
        const v8f e = exp8(vec8::load(w + l) - best);
        std::memcpy(w + l, &e, sizeof e);
        sums += e;
      }
      float sum = vec8::sum(sums);
      for (; l < n; ++l) sum += w[l] = std::exp(w[l] - best);
      total[g] = total[g] * rescale + sum;
      if (rescale != 1.f)
        for (int64_t d = 0; d < hd; ++d) acc[g * hd + d] *= rescale;
    }
    for (int64_t l = 0; l < n; ++l) {
      const float *value = values + l * hd;
      if (l < next_n) prefetch_rows(next_k, l * hd, (l + 1) * hd), prefetch_rows(next_v, l * hd, (l + 1) * hd);
      for (int64_t c = 0; c < vec_hd; c += 8) {
        const v8f v = vec8::load(value + c);
        for (int64_t g = 0; g < groups; ++g) {
          const v8f sum = vec8::load(acc + g * hd + c) + weights[g * B + l] * v;
          std::memcpy(acc + g * hd + c, &sum, sizeof sum);
        }
      }
      for (int64_t g = 0; g < groups; ++g)
        for (int64_t d = vec_hd; d < hd; ++d) acc[g * hd + d] += weights[g * B + l] * value[d];
    }
  }
  for (int64_t g = 0; g < groups; ++g) {
    const float inv = total[g] > 0.f ? 1.f / total[g] : 0.f;
    for (int64_t d = 0; d < hd; ++d) out[g * hd + d] = acc[g * hd + d] * inv;
  }
}

// attend_blocks for these sizes: the default model's shape with its sums in registers (30 layers'
// 16 rows at context 200 with the cache in L3: 2.4 ms against 3.4 for the runtime-sized loop).
inline void attend_paged(const float *q, const float *k_cache, const float *v_cache, const Paged &at,
                         int64_t length, int64_t groups, int64_t hd, float *out, int64_t first = 0) {
  if (groups == 3 && hd == 64)
    return attend_blocks<3, 64>(q, k_cache, v_cache, at, length, first, groups, hd, out);
  attend_blocks<0, 0>(q, k_cache, v_cache, at, length, first, groups, hd, out);
}

}  // namespace rowwise
