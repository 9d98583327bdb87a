// The skinny product over weights packed in column tiles, shared by skinny_matmul.cc and
// decode_layer.cc: out[M, N] (+ residual) = x[M, K] @ W, W packed at load time as [N / TILE, K, TILE]
// (agent/llama_graphs.py pack_for_kernel): each tile of TILE output columns is one contiguous stream,
// read once per block of ROWS rows while ROWS x TILE accumulators stay in registers.
#pragma once

#include <cstdint>

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
