// Opt-in (runtime.activations: int8): Q4_1 products (formats/q4_1.h's packed blocks) of more than
// ABOVE_ROWS rows (prompts, mixed steps, decode steps of more than ABOVE_ROWS streams) with the
// activations quantized per block of 32 as llama.cpp's Q8_1 does: x[k] ~ dx * qx[k] (qx int8,
// dx = max |x| / 127), sx = dx * sum qx; then per block sum_k x[k] w[k][t] ~ d[t] * dx * sum_k qx[k]
// q[k][t] + m[t] * sx, the integer sums by AVX512-VNNI (64 byte products an instruction against a
// float FMA's 16). Not exact: answers may differ from the float32 products', so it is never the
// default. Other formats' products stay float32.
#pragma once

#include <cstdint>
#include <cstring>
#include <vector>

#include "formats/q4_1.h"
#include "packed_matmul.h"

namespace q4i8 {

constexpr int BLOCK = formats::Q4_1::BLOCK;
constexpr int64_t TILE_BYTES = formats::Q4_1::TILE_BYTES;
// Calls of more rows take these products (agent/kernels INT8_ABOVE_ROWS). The 30 layers of a decode
// step at context 160 (tools.model_bench, the 2-core EPYC), float32 -> int8: 4 rows 11.2 -> 10.9 ms,
// 8 rows 18.1 -> 15.2, 16 rows 30.9 -> 24.2, 32 rows 58.5 -> 41.8; a 1024-token prompt 1308 -> 670.
// Up to 4 rows the products stay exact: int8 gains nothing there.
constexpr int64_t ABOVE_ROWS = 4;
// A tile's block unpacked for VPDPBUSD: per group of 4 k and half of TILE columns, 16 x 4 bytes,
// byte (t, kk) = q[4 g + kk][16 half + t].
constexpr int64_t UNPACKED_BYTES = BLOCK * packed::TILE;  // 1024

// Rows of activations quantized per block: q [M, K] int8, d and s [M, K / BLOCK].
struct Rows {
  int8_t *q;
  float *d, *s;
  int64_t k_dim;
};

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
constexpr bool AVAILABLE = true;

inline void quantize_row(const Rows &x, const float *in, int64_t row) {
  const int64_t blocks = x.k_dim / BLOCK;
  const float *xr = in + row * x.k_dim;
  for (int64_t b = 0; b < blocks; ++b) {
    const __m512 lo = _mm512_loadu_ps(xr + b * BLOCK), hi = _mm512_loadu_ps(xr + b * BLOCK + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
    const float d = amax / 127.f, inverse = amax > 0.f ? 127.f / amax : 0.f;
    const __m512i qlo = _mm512_cvtps_epi32(_mm512_mul_ps(lo, _mm512_set1_ps(inverse)));  // to nearest
    const __m512i qhi = _mm512_cvtps_epi32(_mm512_mul_ps(hi, _mm512_set1_ps(inverse)));
    int8_t *q = x.q + row * x.k_dim + b * BLOCK;
    _mm_storeu_si128(reinterpret_cast<__m128i *>(q), _mm512_cvtsepi32_epi8(qlo));
    _mm_storeu_si128(reinterpret_cast<__m128i *>(q + 16), _mm512_cvtsepi32_epi8(qhi));
    x.d[row * blocks + b] = d;
    x.s[row * blocks + b] = d * static_cast<float>(_mm512_reduce_add_epi32(_mm512_add_epi32(qlo, qhi)));
  }
}

// Tile `tile`'s nibbles (formats/q4_1.h: byte (i, t) = q[i][t] | q[i + 16][t] << 4) as UNPACKED_BYTES a block.
inline void unpack(const uint8_t *tile, int64_t blocks, uint8_t *out) {
  const __m128i low = _mm_set1_epi8(0x0F);
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t *qs = tile + b * TILE_BYTES + 4 * packed::TILE;  // after d and m
    uint8_t *o = out + b * UNPACKED_BYTES;
    for (int half = 0; half < 2; ++half)
      for (int g4 = 0; g4 < BLOCK / 8; ++g4) {
        __m128i r[4];
        for (int i = 0; i < 4; ++i)
          r[i] = _mm_loadu_si128(reinterpret_cast<const __m128i *>(qs + (4 * g4 + i) * packed::TILE + 16 * half));
        for (int nibble = 0; nibble < 2; ++nibble) {  // k = 4 g4 + i, then 16 + 4 g4 + i
          __m128i v[4];
          for (int i = 0; i < 4; ++i) v[i] = _mm_and_si128(nibble ? _mm_srli_epi16(r[i], 4) : r[i], low);
          const __m128i a = _mm_unpacklo_epi8(v[0], v[1]), a2 = _mm_unpackhi_epi8(v[0], v[1]);
          const __m128i c = _mm_unpacklo_epi8(v[2], v[3]), c2 = _mm_unpackhi_epi8(v[2], v[3]);
          __m128i *to = reinterpret_cast<__m128i *>(o + ((g4 + 4 * nibble) * 2 + half) * 64);
          _mm_storeu_si128(to, _mm_unpacklo_epi16(a, c));
          _mm_storeu_si128(to + 1, _mm_unpackhi_epi16(a, c));
          _mm_storeu_si128(to + 2, _mm_unpacklo_epi16(a2, c2));
          _mm_storeu_si128(to + 3, _mm_unpackhi_epi16(a2, c2));
        }
      }
  }
}

// Rows [row0, row0 + R) of the tile's TILE columns (col0 on) (+ residual), from its unpacked nibbles
// and its blocks' d and m (in `tile`).
template <int R>
inline void tile_rows(const Rows &x, const uint8_t *unpacked, const uint8_t *tile, const float *residual,
                      float *out, int64_t n_dim, int64_t row0, int64_t col0) {
  const int64_t blocks = x.k_dim / BLOCK;
  __m512 acc[R][2];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    __m512i sums[R][2];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) sums[r][0] = sums[r][1] = _mm512_setzero_si512();
    const uint8_t *wb = unpacked + b * UNPACKED_BYTES;
    const int8_t *xb = x.q + row0 * x.k_dim + b * BLOCK;
#pragma GCC unroll 8
    for (int g = 0; g < BLOCK / 4; ++g) {
      const __m512i w0 = _mm512_loadu_si512(wb + g * 128), w1 = _mm512_loadu_si512(wb + g * 128 + 64);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        int32_t four;
        std::memcpy(&four, xb + r * x.k_dim + 4 * g, sizeof four);
        const __m512i xv = _mm512_set1_epi32(four);
        sums[r][0] = _mm512_dpbusd_epi32(sums[r][0], w0, xv);
        sums[r][1] = _mm512_dpbusd_epi32(sums[r][1], w1, xv);
      }
    }
    const uint8_t *block = tile + b * TILE_BYTES;  // d[TILE], m[TILE] (half)
    const __m512 d[2] = {packed::load_half(block), packed::load_half(block + 32)};
    const __m512 m[2] = {packed::load_half(block + 64), packed::load_half(block + 96)};
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const int64_t at = (row0 + r) * blocks + b;
      const __m512 dx = _mm512_set1_ps(x.d[at]), sx = _mm512_set1_ps(x.s[at]);
#pragma GCC unroll 2
      for (int h = 0; h < 2; ++h) {
        acc[r][h] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums[r][h]), _mm512_mul_ps(d[h], dx), acc[r][h]);
        acc[r][h] = _mm512_fmadd_ps(m[h], sx, acc[r][h]);
      }
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
    for (int h = 0; h < 2; ++h) {
      const int64_t at = (row0 + r) * n_dim + col0 + 16 * h;
      __m512 v = acc[r][h];
      if (residual != nullptr) v = _mm512_add_ps(v, _mm512_loadu_ps(residual + at));
      _mm512_storeu_ps(out + at, v);
    }
}

constexpr int ROWS = 6;  // 2 R sums + 2 R accumulators of AVX-512's 32 registers

// Tile j of x @ W (+ residual) for all m_dim rows of x (quantized), W packed Q4_1 blocks.
inline void tile(const Rows &x, const uint8_t *w, const float *residual, float *out, int64_t m_dim,
                 int64_t n_dim, int64_t j) {
  const int64_t blocks = x.k_dim / BLOCK;
  const uint8_t *tile = w + j * blocks * TILE_BYTES;
  thread_local std::vector<uint8_t> unpacked;
  unpacked.resize(blocks * UNPACKED_BYTES);
  unpack(tile, blocks, unpacked.data());
  packed::equal_blocks(m_dim, ROWS, [&](int64_t row, int64_t n) {
    packed::with_rows<ROWS>(n, [&](auto rows) {
      tile_rows<decltype(rows)::value>(x, unpacked.data(), tile, residual, out, n_dim, row, j * packed::TILE);
    });
  });
}
#else
constexpr bool AVAILABLE = false;  // the ops that use it refuse every call (agent/llama_graphs.py checks first)
inline void quantize_row(const Rows &, const float *, int64_t) {}
inline void tile(const Rows &, const uint8_t *, const float *, float *, int64_t, int64_t, int64_t) {}
#endif

}  // namespace q4i8
