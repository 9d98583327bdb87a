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

// scores[l] = query . keys[l] for l < length. Eight keys at a time with independent accumulators:
// one dot product after another is a chain of dependent FMAs (4 cycles each) that idles the units.
// `ahead`: rows read next (the next block of a paged cache), prefetched row for row alongside: the
// hardware prefetchers do not follow a jump to another block (measured, 48 rows of 1024 positions
// from memory, blocks of 16: 1.84 ms without, 1.63 with, 1.56 reading contiguous rows).
inline void dot_keys(const float *query, const float *keys, int64_t length, int64_t hd, float *scores,
                     const float *ahead = nullptr) {
  int64_t l = 0;
  if (hd % 8 == 0) {
    for (; l + 8 <= length; l += 8) {
      if (ahead != nullptr)
        for (int64_t at = l * hd; at < (l + 8) * hd; at += 16) __builtin_prefetch(ahead + at);
      v8f acc[8] = {};
      for (int64_t c = 0; c < hd; c += 8) {
        const v8f qc = vec8::load(query + c);
        for (int j = 0; j < 8; ++j) acc[j] += qc * vec8::load(keys + (l + j) * hd + c);
      }
      for (int j = 0; j < 8; ++j) scores[l + j] = vec8::sum(acc[j]);
    }
  }
  for (; l < length; ++l) {
    const float *key = keys + l * hd;
    float s = 0.f;
#pragma omp simd reduction(+ : s)
    for (int64_t d = 0; d < hd; ++d) s += query[d] * key[d];
    scores[l] = s;
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

// out[:hd] = sum_l probs[l] * values[l] over the `length` positions of a paged cache, block by
// block; 64 columns at a time in registers (8 accumulators), kept across the blocks, the next
// block's row prefetched with each row (as in dot_keys).
inline void weigh_values_paged(const float *probs, const float *v_cache, const Paged &at, int64_t length,
                               int64_t hd, float *out) {
  const int64_t blocks = (length + at.block - 1) / at.block;
  if (hd % 64 != 0) {
    std::memset(out, 0, sizeof(float) * hd);
    for (int64_t j = 0; j < blocks; ++j) {
      const float *values = at.rows(v_cache, j, hd);
      const int64_t first = j * at.block, n = std::min(at.block, length - first);
      for (int64_t l = 0; l < n; ++l) {
        const float p = probs[first + l];
        const float *value = values + l * hd;
#pragma omp simd
        for (int64_t d = 0; d < hd; ++d) out[d] += p * value[d];
      }
    }
    return;
  }
  for (int64_t c0 = 0; c0 < hd; c0 += 64) {
    v8f acc[8] = {};
    for (int64_t j = 0; j < blocks; ++j) {
      const float *values = at.rows(v_cache, j, hd) + c0;
      const float *next = j + 1 < blocks ? at.rows(v_cache, j + 1, hd) + c0 : nullptr;
      const int64_t first = j * at.block, n = std::min(at.block, length - first);
      for (int64_t l = 0; l < n; ++l) {
        const float *value = values + l * hd;
        if (next != nullptr)
          for (int c = 0; c < 64; c += 16) __builtin_prefetch(next + l * hd + c);
        const float p = probs[first + l];
        for (int c = 0; c < 8; ++c) acc[c] += p * vec8::load(value + 8 * c);
      }
    }
    std::memcpy(out + c0, acc, sizeof acc);
  }
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

// Attention of `groups` query heads [groups, hd] over the `length` cached positions of one
// (sequence, KV head) in a paged cache: out [groups, hd] = softmax(q . K) . V; the scale is already
// in q. Keys are dotted block by block, each block with every query head while its rows are in L1
// (one pass over K instead of one per head: per layer, 48 rows of 1024 positions 1.60 -> 1.50 ms,
// a 445-token prompt's rows 4.8 -> 4.1 ms, against 4.0 reading contiguous rows head by head).
inline void attend_paged(const float *q, const float *k_cache, const float *v_cache, const Paged &at,
                         int64_t length, int64_t groups, int64_t hd, float *out) {
  thread_local std::vector<float> scores;
  scores.resize(groups * length);
  float *s = scores.data();  // [groups, length]
  for (int64_t first = 0, j = 0; first < length; first += at.block, ++j) {
    const float *keys = at.rows(k_cache, j, hd);
    const float *ahead = first + at.block < length ? at.rows(k_cache, j + 1, hd) : nullptr;
    const int64_t n = std::min(at.block, length - first);
    for (int64_t g = 0; g < groups; ++g)
      dot_keys(q + g * hd, keys, n, hd, s + g * length + first, g == 0 ? ahead : nullptr);
  }
  for (int64_t g = 0; g < groups; ++g) {
    softmax(s + g * length, length);
    weigh_values_paged(s + g * length, v_cache, at, length, hd, out + g * hd);
  }
}

}  // namespace rowwise
