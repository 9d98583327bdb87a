// Per-row steps of a decoder layer, shared by elementwise.cc, decode_attention.cc and fused_layer.cc.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "kv_rows.h"
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

// A sequence's cached positions in a paged cache of blocks * kv * block rows (agent/graph_interface.py,
// kv_rows.h): position p of KV head `head` is row (table[p / block] * kv + head) * block + p % block,
// so each block holds `block` consecutive positions of one head in consecutive rows.
struct Paged {
  const int32_t *table;  // the sequence's blocks, position order
  int64_t kv, block, head;

  // The first row of the sequence's j-th block.
  int64_t first_row(int64_t j) const { return (static_cast<int64_t>(table[j]) * kv + head) * block; }
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

// Bytes of a paged cache block to stream from memory while another is computed: into L2, a
// 64-byte line at a time.
inline void prefetch_bytes(const uint8_t *rows, int64_t from, int64_t to) {
  for (int64_t at = from; at < to; at += 64) __builtin_prefetch(rows + at, 0, 2);
}

// Attention of `rows` query rows of one (sequence, KV head) in a paged cache, each `groups` query
// heads [groups, hd] (row r's at q + r * stride, its output at out + r * stride) over its cached
// positions first[r] .. length[r] - 1: out = softmax(q . K) . V; the scale is already in q.
// first[r] > 0: a sliding-window layer's, whose blocks before it are not read at all. One pass over
// the blocks (flash decoding's online softmax): a block's keys are dotted with up to four query
// vectors at a time while in L1, eight keys at a time; the weights are folded into running sums,
// rescaled when a block raises a vector's maximum; then each value row is weighed for every vector
// at once. The blocks two ahead stream into L2 a row with each value row: the hardware prefetchers
// stop at every jump to another block, and the old kernel (a scores pass, a softmax pass and a
// values pass per head, one block prefetched ahead into L1) waited on memory between blocks at
// 15 GB/s of the ~25 two threads stream. Measured (tools.model_bench, decode steps): 16 rows at
// context 1024 76.5 -> ~71 ms, 32 rows 155 -> 112 ms, 32 rows at context 200 74 -> 70 ms.
// Batch invariance: a vector's arithmetic (its dot products' order, its blocks' max/rescale
// sequence, its values' sums in position order) depends only on its own length, first and the
// block size, never on which vectors share its calls: a decode row, a row of a prompt chunk of any
// size and a row whose keys were written by an earlier call give bit-identical results (a prompt's
// rows once attended as products over all keys: its chunking and prefix hits moved greedy answers).
// Rows of a prompt chunk (consecutive lengths) share each block's key and value loads.
template <int64_t GN, int64_t HD>
inline void dot_keys(const float *const *queries, const float *keys, int64_t n, int64_t hd_,
                     float *const *weights) {
  const int64_t hd = HD ? HD : hd_, vec_hd = hd / 8 * 8;
  int64_t l = 0;
  for (; l + 8 <= n; l += 8) {
    v8f dots[GN][8] = {};
    for (int64_t c = 0; c < vec_hd; c += 8)
      for (int k = 0; k < 8; ++k) {
        const v8f key = vec8::load(keys + (l + k) * hd + c);
        for (int64_t g = 0; g < GN; ++g) dots[g][k] += vec8::load(queries[g] + c) * key;
      }
    for (int64_t g = 0; g < GN; ++g) {
      v8f s = vec8::sums(dots[g]);
      for (int k = 0; k < 8; ++k)
        for (int64_t d = vec_hd; d < hd; ++d) s[k] += queries[g][d] * keys[(l + k) * hd + d];
      std::memcpy(weights[g] + l, &s, sizeof s);
    }
  }
  for (; l < n; ++l)
    for (int64_t g = 0; g < GN; ++g) {
      float s = 0.f;
      for (int64_t d = 0; d < hd; ++d) s += queries[g][d] * keys[l * hd + d];
      weights[g][l] = s;
    }
}

template <int64_t HD>
inline void attend_rows(const float *q, const kvrows::Cache &k_cache, const kvrows::Cache &v_cache,
                        const Paged &at, const int64_t *length, const int64_t *first, int64_t rows,
                        int64_t stride, int64_t groups, int64_t hd_, float *out) {
  constexpr int64_t AHEAD = 2, QUERIES = 4;  // blocks prefetched ahead; query vectors a key pass serves
  const int64_t hd = HD ? HD : hd_;
  const int64_t B = at.block, vec_hd = hd / 8 * 8, vectors = rows * groups;
  thread_local std::vector<float> state, dequantized;  // dequantized: a q8_0 block's keys and values
  state.assign(vectors * (hd + B + 2), 0.f);
  if (k_cache.q8 || v_cache.q8) dequantized.resize(2 * B * hd);
  float *acc = state.data();              // [vectors, hd]
  float *weights = acc + vectors * hd;    // [vectors, B]
  float *top = weights + vectors * B, *total = top + vectors;
  std::fill(top, top + vectors, -INFINITY);
  auto query = [&](int64_t v) { return q + (v / groups) * stride + (v % groups) * hd; };
  int64_t from = INT64_MAX, reach = 0;
  for (int64_t r = 0; r < rows; ++r)
    if (length[r] > 0) from = std::min(from, first[r] / B), reach = std::max(reach, length[r]);
  const int64_t blocks = (reach + B - 1) / B;
  for (int64_t j = from; j < blocks; ++j) {
    const int64_t row = at.first_row(j), held = std::min(B, reach - j * B);  // positions any row reads
    const float *block_k = kvrows::rows(k_cache, row, held, hd, dequantized.data());
    const float *block_v = kvrows::rows(v_cache, row, held, hd, dequantized.data() + B * hd);
    const uint8_t *next_k = nullptr, *next_v = nullptr;
    int64_t next_n = 0;
    if (j + AHEAD < blocks) {
      next_k = k_cache.row(at.first_row(j + AHEAD)), next_v = v_cache.row(at.first_row(j + AHEAD));
      next_n = B;
    }
    // Runs of rows that read the same positions of this block (all of a prompt chunk's but in its
    // last blocks) share each key and value load.
    for (int64_t r0 = 0; r0 < rows;) {
      const int64_t skip = std::max<int64_t>(0, first[r0] - j * B);  // positions before `first`
      const int64_t n = std::min(B, length[r0] - j * B) - skip;
      int64_t r1 = r0 + 1;
      while (r1 < rows && std::max<int64_t>(0, first[r1] - j * B) == skip &&
             std::min(B, length[r1] - j * B) - skip == n)
        ++r1;
      const int64_t v0 = r0 * groups, v1 = r1 * groups;
      r0 = r1;
      if (n <= 0) continue;
      const float *keys = block_k + skip * hd, *values = block_v + skip * hd;
      for (int64_t g0 = v0; g0 < v1; g0 += QUERIES) {
        const int64_t gn = std::min(QUERIES, v1 - g0);
        const float *queries[QUERIES];
        float *w[QUERIES];
        for (int64_t g = 0; g < gn; ++g) queries[g] = query(g0 + g), w[g] = weights + (g0 + g) * B;
        if (gn == 4) dot_keys<4, HD>(queries, keys, n, hd, w);
        else if (gn == 3) dot_keys<3, HD>(queries, keys, n, hd, w);
        else if (gn == 2) dot_keys<2, HD>(queries, keys, n, hd, w);
        else dot_keys<1, HD>(queries, keys, n, hd, w);
      }
      for (int64_t g = v0; g < v1; ++g) {
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
        if (l < next_n) {
          const int64_t bytes = k_cache.row_bytes;
          prefetch_bytes(next_k, l * bytes, (l + 1) * bytes), prefetch_bytes(next_v, l * bytes, (l + 1) * bytes);
        }
        for (int64_t c = 0; c < vec_hd; c += 8) {
          const v8f v = vec8::load(value + c);
          for (int64_t g = v0; g < v1; ++g) {
            const v8f sum = vec8::load(acc + g * hd + c) + weights[g * B + l] * v;
            std::memcpy(acc + g * hd + c, &sum, sizeof sum);
          }
        }
        for (int64_t g = v0; g < v1; ++g)
          for (int64_t d = vec_hd; d < hd; ++d) acc[g * hd + d] += weights[g * B + l] * value[d];
      }
      next_n = 0;  // the next blocks stream in once, with the first run's values
    }
  }
  for (int64_t g = 0; g < vectors; ++g) {
    const float inv = total[g] > 0.f ? 1.f / total[g] : 0.f;
    float *o = out + (g / groups) * stride + (g % groups) * hd;
    for (int64_t d = 0; d < hd; ++d) o[d] = acc[g * hd + d] * inv;
  }
}

// attend_rows for these sizes: the default model's head dim with its sums' loops unrolled.
inline void attend_paged_rows(const float *q, const kvrows::Cache &k_cache, const kvrows::Cache &v_cache,
                              const Paged &at,
                              const int64_t *length, const int64_t *first, int64_t rows, int64_t stride,
                              int64_t groups, int64_t hd, float *out) {
  if (hd == 64) return attend_rows<64>(q, k_cache, v_cache, at, length, first, rows, stride, groups, hd, out);
  attend_rows<0>(q, k_cache, v_cache, at, length, first, rows, stride, groups, hd, out);
}

// One row: attend_rows of a row alone (a decode row's).
inline void attend_paged(const float *q, const kvrows::Cache &k_cache, const kvrows::Cache &v_cache,
                         const Paged &at,
                         int64_t length, int64_t groups, int64_t hd, float *out, int64_t first = 0) {
  attend_paged_rows(q, k_cache, v_cache, at, &length, &first, 1, groups * hd, groups, hd, out);
}

}  // namespace rowwise
