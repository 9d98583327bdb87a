// One product interface over every weight format: a matrix is its packed weights and a format id
// (GGML's type number: formats/*.h ID, agent/model/quantized.py), and tile j of x @ W (+ residual)
// is computed the same way whatever the format (packed_matmul.h). F32 is float32 tiles
// [N / TILE, K, TILE] (the weights of checkpoints that are not GGUF, and GGUF types without a kernel).
#pragma once

#include <cstdint>

#include "formats/f16.h"
#include "formats/q2_k.h"
#include "formats/q3_k.h"
#include "formats/q4_0.h"
#include "formats/q4_1.h"
#include "formats/q4_k.h"
#include "formats/q5_0.h"
#include "formats/q5_1.h"
#include "formats/q5_k.h"
#include "formats/q6_k.h"
#include "formats/q8_0.h"
#include "packed_matmul.h"

namespace product {

constexpr int32_t F32 = 0;

// visit(format, use): use(F{}) with the format struct of a quantized id; false for F32 and unknown ids.
template <class Use>
inline bool visit(int32_t format, Use use) {
  switch (format) {
    case formats::Q4_0::ID: use(formats::Q4_0{}); return true;
    case formats::Q4_1::ID: use(formats::Q4_1{}); return true;
    case formats::Q5_0::ID: use(formats::Q5_0{}); return true;
    case formats::Q5_1::ID: use(formats::Q5_1{}); return true;
    case formats::Q8_0::ID: use(formats::Q8_0{}); return true;
    case formats::Q2_K::ID: use(formats::Q2_K{}); return true;
    case formats::Q3_K::ID: use(formats::Q3_K{}); return true;
    case formats::Q4_K::ID: use(formats::Q4_K{}); return true;
    case formats::Q5_K::ID: use(formats::Q5_K{}); return true;
    case formats::Q6_K::ID: use(formats::Q6_K{}); return true;
    case formats::F16::ID: use(formats::F16{}); return true;
    case formats::BF16::ID: use(formats::BF16{}); return true;
    default: return false;
  }
}

// A matrix of n_dim = tiles * TILE output columns over k_dim inputs.
struct Matrix {
  const void *w = nullptr;
  int32_t format = F32;
  int64_t tiles = 0, k_dim = 0;

  int64_t n_dim() const { return tiles * packed::TILE; }
};

// The matrix of an op's input `w` with its shape (rank 3: F32 [tiles, K, TILE] float32, a quantized
// format [tiles, K / BLOCK, TILE_BYTES] uint8); false where the shape does not fit the format.
inline bool read_matrix(const void *w, int32_t format, int ndim, const int64_t *shape, Matrix &m) {
  if (ndim != 3 || shape[0] <= 0 || shape[1] <= 0) return false;
  m.w = w, m.format = format, m.tiles = shape[0];
  if (format == F32) {
    m.k_dim = shape[1];
    return shape[2] == packed::TILE;
  }
  bool fits = false;
  visit(format, [&](auto f) {
    using F = decltype(f);
    m.k_dim = shape[1] * F::BLOCK;
    fits = shape[2] == F::TILE_BYTES;
  });
  return fits;
}

// Tile j of x [m_dim, K] @ W (+ residual) into out's columns [j * TILE, (j + 1) * TILE), out and
// residual rows n_stride apart.
inline void tile(const Matrix &m, const float *x, const float *residual, float *out, int64_t m_dim,
                 int64_t n_stride, int64_t j) {
  if (m.format == F32) {
    packed::tile(x, static_cast<const float *>(m.w), residual, out, m_dim, m.k_dim, n_stride, j);
    return;
  }
  visit(m.format, [&](auto f) {
    packed::quantized_tile<decltype(f)>(x, static_cast<const uint8_t *>(m.w), residual, out, m_dim, m.k_dim,
                                        n_stride, j);
  });
}

// Row `row` of the matrix as float32 [k_dim] (an embedding's row).
inline void matrix_row(const Matrix &m, int64_t row, float *out) {
  if (m.format == F32) {
    const float *w = static_cast<const float *>(m.w) + row / packed::TILE * m.k_dim * packed::TILE;
    for (int64_t k = 0; k < m.k_dim; ++k) out[k] = w[k * packed::TILE + row % packed::TILE];
    return;
  }
  visit(m.format, [&](auto f) {
    packed::matrix_row<decltype(f)>(static_cast<const uint8_t *>(m.w), m.k_dim, row, out);
  });
}

}  // namespace product
