// The skinny product over weights packed in column tiles, shared by skinny_matmul.cc and
// decode_layer.cc: out[M, N] (+ residual) = x[M, K] @ W, W packed at load time as [N / TILE, K, TILE]
// (agent/llama_graphs.py pack_for_kernel): each tile of TILE output columns is one contiguous stream,
// read once per block of ROWS rows while ROWS x TILE accumulators stay in registers.
#pragma once

#include <cstdint>
#include <cstring>

#include "vec8.h"

namespace packed {

constexpr int TILE = 32;
constexpr int ROWS = 8;

template <int R>
inline void tile_rows(const float *x, int64_t k_dim, const float *w_tile, const float *residual,
                      float *out, int64_t n_dim, int64_t row0, int64_t col0) {
  float acc[R][TILE];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < TILE; ++t) acc[r][t] = 0.f;
  for (int64_t k = 0; k < k_dim; ++k) {
    const float *w = w_tile + k * TILE;
    for (int r = 0; r < R; ++r) {
      const float a = x[(row0 + r) * k_dim + k];
#pragma omp simd
      for (int t = 0; t < TILE; ++t) acc[r][t] += a * w[t];
    }
  }
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < TILE; ++t) {
      const int64_t at = (row0 + r) * n_dim + col0 + t;
      out[at] = residual == nullptr ? acc[r][t] : residual[at] + acc[r][t];
    }
}

// Tile j of the product for all m_dim rows; out and residual are [M, n_dim], n_dim = tiles * TILE.
inline void tile(const float *x, const float *w, const float *residual, float *out, int64_t m_dim,
                 int64_t k_dim, int64_t n_dim, int64_t j) {
  const float *w_tile = w + j * k_dim * TILE;
  const int64_t col = j * TILE;
  int64_t row = 0;
  for (; row + ROWS <= m_dim; row += ROWS) tile_rows<ROWS>(x, k_dim, w_tile, residual, out, n_dim, row, col);
  if (row + 4 <= m_dim) { tile_rows<4>(x, k_dim, w_tile, residual, out, n_dim, row, col); row += 4; }
  if (row + 2 <= m_dim) { tile_rows<2>(x, k_dim, w_tile, residual, out, n_dim, row, col); row += 2; }
  if (row < m_dim) tile_rows<1>(x, k_dim, w_tile, residual, out, n_dim, row, col);
}

}  // namespace packed

// The same product with W kept in GGUF's Q4_1 blocks, for a few rows (a decode step of one or two
// sequences), where reading the weights is the whole cost: 0.75 bytes a weight instead of fp32's 4.
// Packed at load time (agent/quantized.py) as [N / TILE, K / 32, Q4_TILE_BYTES]: per tile and block of
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
    const uint8_t *qs = block + 2 * packed::TILE * 4;
    const float *xb = xr + b * BLOCK;
    v8f acc[G] = {};
    float x_sum = 0.f;
    for (int i = 0; i < BLOCK / 2; ++i) {
      const float lo_x = xb[i], hi_x = xb[i + BLOCK / 2];
      x_sum += lo_x + hi_x;
      for (int g = 0; g < G; ++g) {
        const v8i q = vec8::widen(qs + i * packed::TILE + 8 * g);
        acc[g] += lo_x * __builtin_convertvector(q & 15, v8f) + hi_x * __builtin_convertvector(q >> 4, v8f);
      }
    }
    for (int g = 0; g < G; ++g) {
      v8f d, m;
      std::memcpy(&d, block + 32 * g, sizeof d);
      std::memcpy(&m, block + packed::TILE * 4 + 32 * g, sizeof m);
      total[g] += d * acc[g] + m * x_sum;
    }
  }
  float *o = out + row * n_dim + j * packed::TILE;
  const float *res = residual == nullptr ? nullptr : residual + row * n_dim + j * packed::TILE;
  for (int g = 0; g < G; ++g)
    for (int t = 0; t < 8; ++t) o[8 * g + t] = (res == nullptr ? 0.f : res[8 * g + t]) + total[g][t];
}

inline void tile(const float *x, const uint8_t *w, const float *residual, float *out, int64_t m_dim,
                 int64_t k_dim, int64_t n_dim, int64_t j) {
  for (int64_t row = 0; row < m_dim; ++row) tile_row(x, k_dim, w, residual, out, n_dim, row, j);
}

}  // namespace q4
