// The product over weights packed in column tiles, shared by skinny_matmul.cc and fused_layer.cc:
// out[M, N] (+ residual) = x[M, K] @ W, W packed at load time as [N / TILE, K, TILE]
// (agent/llama_graphs.py pack_for_kernel): each tile of TILE output columns is one contiguous stream,
// read once per block of ROWS rows while ROWS x TILE accumulators stay in registers.
#pragma once

#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "vec8.h"

namespace packed {

constexpr int TILE = 32;

// Accumulators are vector variables the compiler keeps in registers: written as float arrays with
// `omp simd`, GCC kept them on the stack and loaded and stored them around every FMA (a 128-token
// prefill ran its products at ~70 GFLOP/s; held in registers, ~270, measured on the 2-core Xeon).
// AVX-512 has 32 registers: 12 rows x 2 vectors of 16; AVX2 16: 3 rows x 4 vectors of 8.
#ifdef __AVX512F__
constexpr int LANES = 16;
constexpr int ROWS = 12;
#else
constexpr int LANES = 8;
constexpr int ROWS = 3;
#endif
constexpr int VECTORS = TILE / LANES;
typedef float vf __attribute__((vector_size(LANES * sizeof(float))));
typedef int32_t vi __attribute__((vector_size(LANES * sizeof(int32_t))));

// LANES bytes widened to LANES int32, unsigned and signed: the dequantizers' loads, a whole register
// at a time (on AVX-512, 16 lanes instead of 8: 30 layers at batch 16, 27.1 -> 26.0 ms in one process).
inline vi widen(const uint8_t *p) {
#ifdef __AVX512F__
  return (vi)_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i *>(p)));
#else
  return vec8::widen(p);
#endif
}

inline vi widen_signed(const uint8_t *p) {
#ifdef __AVX512F__
  return (vi)_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i *>(p)));
#else
  return vec8::widen_signed(p);
#endif
}

// Rows [row0, row0 + R) of out's columns [col0, col0 + TILE) (+ residual), from the tile's rows
// w_tile [k_dim, TILE].
template <int R>
inline void tile_rows(const float *x, int64_t k_dim, const float *w_tile, const float *residual, float *out,
                      int64_t n_dim, int64_t row0, int64_t col0) {
  vf acc[R][VECTORS];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int c = 0; c < VECTORS; ++c) acc[r][c] = vf{};
  const float *xr = x + row0 * k_dim;
  for (int64_t k = 0; k < k_dim; ++k) {
    vf w[VECTORS];
#pragma GCC unroll 4
    for (int c = 0; c < VECTORS; ++c) std::memcpy(&w[c], w_tile + k * TILE + c * LANES, sizeof(vf));
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const float a = xr[r * k_dim + k];
#pragma GCC unroll 4
      for (int c = 0; c < VECTORS; ++c) acc[r][c] += a * w[c];
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int c = 0; c < VECTORS; ++c) {
      const int64_t at = (row0 + r) * n_dim + col0 + c * LANES;
      vf v = acc[r][c];
      if (residual != nullptr) {
        vf res;
        std::memcpy(&res, residual + at, sizeof res);
        v += res;
      }
      std::memcpy(out + at, &v, sizeof v);
    }
}

// body(std::integral_constant<int, n>{}) for a run-time n in [1, R]: a block's row count known at
// compile time, so its accumulators are registers.
template <int R, class Body>
inline void with_rows(int64_t n, Body body) {
  if constexpr (R > 0) {
    if (n == R) body(std::integral_constant<int, R>{});
    else with_rows<R - 1>(n, body);
  }
}

// body(row0, n) over m_dim rows in equal blocks of at most max_rows (16 rows in blocks of 12: 8 + 8,
// not 12 + 4, where a small block reads the tile for few FMAs).
template <class Body>
inline void equal_blocks(int64_t m_dim, int64_t max_rows, Body body) {
  const int64_t blocks = (m_dim + max_rows - 1) / max_rows;
  for (int64_t b = 0, row = 0; b < blocks; ++b) {
    const int64_t n = (m_dim - row) / (blocks - b);  // the remaining rows shared over the remaining blocks
    body(row, n);
    row += n;
  }
}

// The columns [col0, col0 + TILE) of the product for all m_dim rows (as tile_rows), from the tile's
// rows `w_tile` [k_dim, TILE]; out and residual are [M, n_dim].
inline void columns(const float *x, const float *w_tile, const float *residual, float *out, int64_t m_dim,
                    int64_t k_dim, int64_t n_dim, int64_t col0) {
  equal_blocks(m_dim, ROWS, [&](int64_t row, int64_t n) {
    with_rows<ROWS>(n, [&](auto rows) {
      tile_rows<decltype(rows)::value>(x, k_dim, w_tile, residual, out, n_dim, row, col0);
    });
  });
}

// Tile j of the product for all m_dim rows; n_dim = tiles * TILE.
inline void tile(const float *x, const float *w, const float *residual, float *out, int64_t m_dim,
                 int64_t k_dim, int64_t n_dim, int64_t j) {
  columns(x, w + j * k_dim * TILE, residual, out, m_dim, k_dim, n_dim, j * TILE);
}

// Row `row` of tile j, its TILE sums in TILE / 8 vectors, into out (+ residual): the one-row
// quantized paths' last step.
inline void store_row(const vec8::v8f *total, const float *residual, float *out, int64_t n_dim, int64_t row,
                      int64_t j) {
  float *o = out + row * n_dim + j * TILE;
  const float *res = residual == nullptr ? nullptr : residual + row * n_dim + j * TILE;
  for (int g = 0; g < TILE / 8; ++g)
    for (int t = 0; t < 8; ++t) o[8 * g + t] = (res == nullptr ? 0.f : res[8 * g + t]) + total[g][t];
}

// Quantized weights stream from memory (a decode step's layers and LM head are read once a step and
// do not stay in the cache): each block asks for the one PREFETCH_BLOCKS ahead (past a tile's end,
// the next tile, which follows it in memory), as the hardware prefetcher, which restarts at every
// short tile stream, does not. 30 layers at batch 1: 6.0 -> 4.5 ms on the 2-core Xeon.
constexpr int64_t PREFETCH_BLOCKS = 8;

inline void prefetch_block(const uint8_t *block, int64_t block_bytes) {
  const uint8_t *ahead = block + PREFETCH_BLOCKS * block_bytes;
  for (int64_t line = 0; line < block_bytes; line += 64) __builtin_prefetch(ahead + line);
}

using RowFn = void (*)(const float *, int64_t, const uint8_t *, const float *, float *, int64_t, int64_t,
                       int64_t);

// A quantized format is described by Blocks: BLOCK (k positions a block), TILE_BYTES (a tile's
// block of TILE columns), ROW_BY_ROW (up to how many rows its Row is faster than direct_rows) and
// Blocks::weights(block, c, use), which calls use(i, w) with the block's weights of columns vector
// c at its k = i, for every i.

// Tile j as float32 [k_dim, TILE] (tile's layout).
template <class Blocks>
inline void dequantize(const uint8_t *w, int64_t k_dim, int64_t j, float *out) {
  const int64_t blocks = k_dim / Blocks::BLOCK;
  const uint8_t *tile = w + j * blocks * Blocks::TILE_BYTES;
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t *block = tile + b * Blocks::TILE_BYTES;
    prefetch_block(block, Blocks::TILE_BYTES);
    float *rows = out + b * Blocks::BLOCK * TILE;
    for (int c = 0; c < VECTORS; ++c)
      Blocks::weights(block, c, [&](int i, vf weight) {
        std::memcpy(rows + i * TILE + c * LANES, &weight, sizeof weight);
      });
  }
}

// Rows [row0, row0 + R) of tile j straight from its blocks, a vector of columns at a time (the
// tile's second pass reads it from the cache): each weight is dequantized once, in registers, for
// all R rows (R accumulators and the block's scales; 16 rows on AVX-512's 32 registers).
template <class Blocks, int R>
inline void direct_rows(const float *x, int64_t k_dim, const uint8_t *w, const float *residual, float *out,
                        int64_t n_dim, int64_t row0, int64_t j) {
  const int64_t blocks = k_dim / Blocks::BLOCK;
  const uint8_t *tile = w + j * blocks * Blocks::TILE_BYTES;
  const float *xr = x + row0 * k_dim;
  for (int c = 0; c < VECTORS; ++c) {
    vf acc[R];
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) acc[r] = vf{};
    for (int64_t b = 0; b < blocks; ++b) {
      const uint8_t *block = tile + b * Blocks::TILE_BYTES;
      if (c == 0) prefetch_block(block, Blocks::TILE_BYTES);
      const float *xb = xr + b * Blocks::BLOCK;
      Blocks::weights(block, c, [&](int i, vf weight) {
#pragma GCC unroll 16
        for (int r = 0; r < R; ++r) acc[r] += xb[r * k_dim + i] * weight;
      });
    }
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const int64_t at = (row0 + r) * n_dim + j * TILE + c * LANES;
      vf v = acc[r];
      if (residual != nullptr) {
        vf res;
        std::memcpy(&res, residual + at, sizeof res);
        v += res;
      }
      std::memcpy(out + at, &v, sizeof v);
    }
  }
}

// Tile j of a product with quantized weights (Blocks: Q4_1's or Q8_0's), for all m_dim rows.
// Decode reads its weights from memory every step (22-27 GB/s on the 2-core EPYC): Q4_1's 0.75
// bytes a weight instead of 4 is what makes a step of 16 rows fast.
// - Up to Blocks::ROW_BY_ROW rows, Row, a row at a time (the second reads the tile from the cache).
// - Up to DIRECT_ROWS, straight from the blocks (direct_rows) in blocks of up to DIRECT_BLOCK rows:
//   a dequantized tile's stores and loads cost more than dequantizing each weight again per block.
//   The 30 layers' Q4_1 products from memory, 2 EPYC cores: 4 rows 10.1 -> 7.5 ms, 16 rows 19.9 ->
//   17.8, 32 rows 35.6 -> 34.2; the Q8_0 LM head: 4 rows 3.1 -> 1.6 ms, 16 rows 6.2 -> 5.2.
// - More: the tile dequantized whole (into this thread's buffer) and multiplied as float32 tiles
//   are. At 48 and 64 rows direct was 1-3% faster for the layers and 5-7% slower for the LM head.
constexpr int DIRECT_BLOCK = LANES == 16 ? 16 : 8;  // accumulators + the block's scales and weights
constexpr int64_t DIRECT_ROWS = 32;

template <class Blocks, RowFn Row>
inline void quantized_tile(const float *x, const uint8_t *w, const float *residual, float *out,
                           int64_t m_dim, int64_t k_dim, int64_t n_dim, int64_t j) {
  if (m_dim <= Blocks::ROW_BY_ROW) {
    for (int64_t row = 0; row < m_dim; ++row) Row(x, k_dim, w, residual, out, n_dim, row, j);
  } else if (m_dim <= DIRECT_ROWS) {
    equal_blocks(m_dim, DIRECT_BLOCK, [&](int64_t row, int64_t n) {
      with_rows<DIRECT_BLOCK>(n, [&](auto rows) {
        direct_rows<Blocks, decltype(rows)::value>(x, k_dim, w, residual, out, n_dim, row, j);
      });
    });
  } else {
    thread_local std::vector<float> weights;
    weights.resize(k_dim * TILE);
    dequantize<Blocks>(w, k_dim, j, weights.data());
    columns(x, weights.data(), residual, out, m_dim, k_dim, n_dim, j * TILE);
  }
}

}  // namespace packed

// The same product with W kept in GGUF's Q4_1 blocks (packed::quantized_tile): 0.75 bytes a weight
// read instead of fp32's 4. Packed at load time (agent/model/quantized.py) as [N / TILE, K / 32, Q4_TILE_BYTES]: per tile and block of
// 32 k, float d[TILE], float m[TILE], then 16 x TILE bytes, byte (i, t) = q[i][t] | q[i + 16][t] << 4
// (GGUF's own pairing within a block). Weight (k, t) = d[t] * q[k][t] + m[t], exactly as
// gguf.quants.dequantize, so the product is an fp32 product with the dequantized matrix:
// sum_k x[k] w[k][t] = d[t] * sum_k x[k] q[k][t] + m[t] * sum_k x[k], per block.
namespace q4 {

constexpr int BLOCK = 32;
constexpr int64_t TILE_BYTES = 2 * packed::TILE * 4 + BLOCK / 2 * packed::TILE;  // 768

using vec8::v8f;
using vec8::v8i;

// Tile j of out[row] (+ residual[row]) for one row of x.
inline void tile_row(const float *x, int64_t k_dim, const uint8_t *w, const float *residual, float *out,
                     int64_t n_dim, int64_t row, int64_t j) {
  constexpr int G = packed::TILE / 8;
  const int64_t blocks = k_dim / BLOCK;
  const uint8_t *tile = w + j * blocks * TILE_BYTES;
  const float *xr = x + row * k_dim;
  v8f total[G] = {};
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t *block = tile + b * TILE_BYTES;
    packed::prefetch_block(block, TILE_BYTES);
    const uint8_t *qs = block + 2 * packed::TILE * 4;
    const float *xb = xr + b * BLOCK;
    // The low and high nibbles' sums apart: an FMA each (one sum took a multiply, an FMA and an
    // add; 0.052 -> 0.044 ns a weight on one EPYC core, the tile in cache).
    v8f lo_acc[G] = {}, hi_acc[G] = {};
    float x_sum = 0.f;
    for (int i = 0; i < BLOCK / 2; ++i) {
      const float lo_x = xb[i], hi_x = xb[i + BLOCK / 2];
      x_sum += lo_x + hi_x;
      for (int g = 0; g < G; ++g) {
        const v8i q = vec8::widen(qs + i * packed::TILE + 8 * g);
        lo_acc[g] += lo_x * __builtin_convertvector(q & 15, v8f);
        hi_acc[g] += hi_x * __builtin_convertvector(q >> 4, v8f);
      }
    }
    for (int g = 0; g < G; ++g) {
      v8f d, m;
      std::memcpy(&d, block + 32 * g, sizeof d);
      std::memcpy(&m, block + packed::TILE * 4 + 32 * g, sizeof m);
      total[g] += d * (lo_acc[g] + hi_acc[g]) + m * x_sum;
    }
  }
  packed::store_row(total, residual, out, n_dim, row, j);
}

// Tile j's blocks (packed's Blocks): column vector c's weights d * q + m at each k of a block.
struct Blocks {
  static constexpr int64_t ROW_BY_ROW = 1;  // 2 rows direct: 5.5 -> 4.2 ms (the 30 layers)
  static constexpr int BLOCK = q4::BLOCK;
  static constexpr int64_t TILE_BYTES = q4::TILE_BYTES;
  template <class Use>
  static void weights(const uint8_t *block, int c, Use use) {
    using packed::LANES;
    using packed::vf;
    vf d, m;
    std::memcpy(&d, block + 4 * LANES * c, sizeof d);
    std::memcpy(&m, block + packed::TILE * 4 + 4 * LANES * c, sizeof m);
    const uint8_t *qs = block + 2 * packed::TILE * 4 + LANES * c;
    for (int i = 0; i < BLOCK / 2; ++i) {
      const packed::vi q = packed::widen(qs + i * packed::TILE);
      use(i, d * __builtin_convertvector(q & 15, vf) + m);
      use(i + BLOCK / 2, d * __builtin_convertvector(q >> 4, vf) + m);
    }
  }
};

inline void tile(const float *x, const uint8_t *w, const float *residual, float *out, int64_t m_dim,
                 int64_t k_dim, int64_t n_dim, int64_t j) {
  packed::quantized_tile<Blocks, tile_row>(x, w, residual, out, m_dim, k_dim, n_dim, j);
}

}  // namespace q4

// Opt-in (runtime.activations: int8): Q4_1 products of more than ABOVE_ROWS rows (prompts, mixed
// steps, decode steps of more than ABOVE_ROWS streams) with the activations quantized per block of
// 32 as llama.cpp's Q8_1 does: x[k] ~ dx * qx[k] (qx int8, dx = max |x| / 127), sx = dx * sum qx; then per block
// sum_k x[k] w[k][t] ~ d[t] * dx * sum_k qx[k] q[k][t] + m[t] * sx, the integer sums by AVX512-VNNI
// (64 byte products an instruction against a float FMA's 16). Not exact: answers may differ from the
// float32 products', so it is never the default.
namespace q4i8 {

constexpr int BLOCK = q4::BLOCK;
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

// Tile `tile`'s nibbles (q4's layout: byte (i, t) = q[i][t] | q[i + 16][t] << 4) as UNPACKED_BYTES a block.
inline void unpack(const uint8_t *tile, int64_t blocks, uint8_t *out) {
  const __m128i low = _mm_set1_epi8(0x0F);
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t *qs = tile + b * q4::TILE_BYTES + 2 * packed::TILE * 4;
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
    const float *block = reinterpret_cast<const float *>(tile + b * q4::TILE_BYTES);  // d[TILE], m[TILE]
    const __m512 d[2] = {_mm512_loadu_ps(block), _mm512_loadu_ps(block + 16)};
    const __m512 m[2] = {_mm512_loadu_ps(block + packed::TILE), _mm512_loadu_ps(block + packed::TILE + 16)};
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

// Tile j of x @ W (+ residual) for all m_dim rows of x (quantized), W q4's packed blocks.
inline void tile(const Rows &x, const uint8_t *w, const float *residual, float *out, int64_t m_dim,
                 int64_t n_dim, int64_t j) {
  const int64_t blocks = x.k_dim / BLOCK;
  const uint8_t *tile = w + j * blocks * q4::TILE_BYTES;
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

// The same for GGUF's Q8_0 (the default model's tied embedding, which is its LM head), packed at
// load time (agent/model/quantized.py Q8Matrix) as [N / TILE, K / 32, Q8_TILE_BYTES]: per tile and
// block of 32 k, float d[TILE], then 32 x TILE int8, byte (i, t) = q[i][t]. Weight (k, t) =
// d[t] * q[k][t], exactly as gguf.quants.dequantize.
namespace q8 {

constexpr int BLOCK = 32;
constexpr int64_t TILE_BYTES = packed::TILE * 4 + BLOCK * packed::TILE;  // 1152

using vec8::v8f;

inline void tile_row(const float *x, int64_t k_dim, const uint8_t *w, const float *residual, float *out,
                     int64_t n_dim, int64_t row, int64_t j) {
  constexpr int G = packed::TILE / 8;
  const int64_t blocks = k_dim / BLOCK;
  const uint8_t *tile = w + j * blocks * TILE_BYTES;
  const float *xr = x + row * k_dim;
  v8f total[G] = {};
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t *block = tile + b * TILE_BYTES;
    packed::prefetch_block(block, TILE_BYTES);
    const uint8_t *qs = block + packed::TILE * 4;
    const float *xb = xr + b * BLOCK;
    v8f acc[G] = {};
    for (int i = 0; i < BLOCK; ++i)
      for (int g = 0; g < G; ++g)
        acc[g] += xb[i] * __builtin_convertvector(vec8::widen_signed(qs + i * packed::TILE + 8 * g), v8f);
    for (int g = 0; g < G; ++g) {
      v8f d;
      std::memcpy(&d, block + 32 * g, sizeof d);
      total[g] += d * acc[g];
    }
  }
  packed::store_row(total, residual, out, n_dim, row, j);
}

// Tile j's blocks (packed's Blocks): column vector c's weights d * q at each k of a block.
struct Blocks {
  static constexpr int64_t ROW_BY_ROW = 2;  // 2 rows direct: 1.1 -> 1.35 ms (the LM head)
  static constexpr int BLOCK = q8::BLOCK;
  static constexpr int64_t TILE_BYTES = q8::TILE_BYTES;
  template <class Use>
  static void weights(const uint8_t *block, int c, Use use) {
    using packed::LANES;
    using packed::vf;
    vf d;
    std::memcpy(&d, block + 4 * LANES * c, sizeof d);
    const uint8_t *qs = block + packed::TILE * 4 + LANES * c;
    for (int i = 0; i < BLOCK; ++i)
      use(i, d * __builtin_convertvector(packed::widen_signed(qs + i * packed::TILE), vf));
  }
};

inline void tile(const float *x, const uint8_t *w, const float *residual, float *out, int64_t m_dim,
                 int64_t k_dim, int64_t n_dim, int64_t j) {
  packed::quantized_tile<Blocks, tile_row>(x, w, residual, out, m_dim, k_dim, n_dim, j);
}

}  // namespace q8
