// The product over weights packed in column tiles, shared by skinny_matmul.cc and fused_layer.cc
// through product.h: out[M, N] (+ residual) = x[M, K] @ W, W packed at load time as float32
// [N / TILE, K, TILE] (agent/llama_graphs.py pack_for_kernel) or as a file's blocks
// (formats/format.h): each tile of TILE output columns is one contiguous stream, read once per block
// of rows while their accumulators stay in registers.
#pragma once

#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>
#include <vector>

#include "lanes.h"

namespace packed {

// Accumulators are vector variables the compiler keeps in registers: written as float arrays with
// `omp simd`, GCC kept them on the stack and loaded and stored them around every FMA (a 128-token
// prefill ran its products at ~70 GFLOP/s; held in registers, ~270, measured on the 2-core Xeon).
// AVX-512 has 32 registers: 12 rows x 2 vectors of 16; AVX2 16: 3 rows x 4 vectors of 8.
constexpr int ROWS = LANES == 16 ? 12 : 3;

// out[at, at + LANES) = v (+ residual there): a product's row of columns stored.
inline void store(float *out, const float *residual, int64_t at, vf v) {
  if (residual != nullptr) {
    vf res;
    std::memcpy(&res, residual + at, sizeof res);
    v += res;
  }
  std::memcpy(out + at, &v, sizeof v);
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
      store(out, residual, (row0 + r) * n_dim + col0 + c * LANES, acc[r][c]);
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

// Quantized weights stream from memory (a decode step's layers and LM head are read once a step and
// do not stay in the cache): each block asks for the bytes PREFETCH_BYTES ahead (past a tile's end,
// the next tile, which follows it in memory), as the hardware prefetcher, which restarts at every
// short tile stream, does not. 30 Q4_1 layers at batch 1: 6.0 -> 4.5 ms on the 2-core Xeon.
constexpr int64_t PREFETCH_BYTES = 6144;

inline void prefetch_block(const uint8_t *block, int64_t block_bytes) {
  const uint8_t *ahead = block + PREFETCH_BYTES;
  for (int64_t line = 0; line < block_bytes; line += 64) __builtin_prefetch(ahead + line);
}

// The products of a weight format F (formats/format.h) for tile j, built from F::subs.

// N of a formats::Group<N>.
template <class G>
constexpr int group_size() {
  return std::extent_v<decltype(G::s)>;
}

// The group's weights: scale * q + offset (scale * q for formats without offsets).
template <class F, int N, class Q>
inline void weights_of(const vf *scale, const vf *offset, const Q (&q)[N], vf (&w)[N]) {
#pragma GCC unroll 4
  for (int n = 0; n < N; ++n) {
    const vf quant = to_float(q[n]);
    w[n] = F::OFFSET ? scale[n] * quant + offset[n] : scale[n] * quant;
  }
}

// The quants' type of a group (formats/format.h Group::Quant).
template <class G>
using quant_of = typename std::decay_t<G>::Quant;

// Row `row` of tile j (+ residual), a sub-block at a time: sum_i x[i] q[i] in float32, times the
// sub-block's scale, plus its offset times sum_i x[i].
template <class F>
inline void row_tile(const float *x, int64_t k_dim, const uint8_t *w, const float *residual, float *out,
                     int64_t n_dim, int64_t row, int64_t j) {
  const int64_t blocks = k_dim / F::BLOCK;
  const uint8_t *tile = w + j * blocks * F::TILE_BYTES;
  const float *xr = x + row * k_dim;
  thread_local std::vector<float> sums;  // each sub-block's sum of x, for the offsets
  if constexpr (F::OFFSET) {
    sums.resize(k_dim / F::SUB);
    for (int64_t s = 0; s < k_dim / F::SUB; ++s) {
      float total = 0.f;
#pragma omp simd reduction(+ : total)
      for (int i = 0; i < F::SUB; ++i) total += xr[s * F::SUB + i];
      sums[s] = total;
    }
  }
  vf total[VECTORS] = {};
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t *block = tile + b * F::TILE_BYTES;
    prefetch_block(block, F::TILE_BYTES);
    const float *xb = xr + b * F::BLOCK;
    const int64_t first_sub = b * (F::BLOCK / F::SUB);
#pragma GCC unroll 4
    for (int c = 0; c < VECTORS; ++c)
      F::subs(block, c, [&](const auto &group, auto quants) {
        constexpr int N = group_size<std::decay_t<decltype(group)>>();
        // two FMA chains a sub-block, taking turns (one group of one sub-block is a chain of 32)
        vf acc[N] = {}, other[N] = {};
        quants([&](int i, const quant_of<decltype(group)> (&q)[N]) {
#pragma GCC unroll 4
          for (int n = 0; n < N; ++n) {
            acc[n] += xb[group.s[n] * F::SUB + i] * to_float(q[n]);
            std::swap(acc[n], other[n]);
          }
        });
#pragma GCC unroll 4
        for (int n = 0; n < N; ++n) {
          total[c] += group.scale[n] * (acc[n] + other[n]);
          if constexpr (F::OFFSET) total[c] += group.offset[n] * sums[first_sub + group.s[n]];
        }
      });
  }
#pragma GCC unroll 4
  for (int c = 0; c < VECTORS; ++c) {
    store(out, residual, row * n_dim + j * TILE + c * LANES, total[c]);
  }
}

// Tile j as float32 [k_dim, TILE] (the float32 tiles' layout).
template <class F>
inline void dequantize(const uint8_t *w, int64_t k_dim, int64_t j, float *out) {
  const int64_t blocks = k_dim / F::BLOCK;
  const uint8_t *tile = w + j * blocks * F::TILE_BYTES;
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t *block = tile + b * F::TILE_BYTES;
    prefetch_block(block, F::TILE_BYTES);
    float *rows = out + b * F::BLOCK * TILE;
    for (int c = 0; c < VECTORS; ++c)
      F::subs(block, c, [&](const auto &group, auto quants) {
        constexpr int N = group_size<std::decay_t<decltype(group)>>();
        quants([&](int i, const quant_of<decltype(group)> (&q)[N]) {
          vf weight[N];
          weights_of<F, N>(group.scale, group.offset, q, weight);
          for (int n = 0; n < N; ++n)
            std::memcpy(rows + (group.s[n] * F::SUB + i) * TILE + c * LANES, &weight[n], sizeof(vf));
        });
      });
  }
}

// Row `row` of the matrix (column `row` of the product) as float32 [k_dim]: an embedding's row.
template <class F>
inline void matrix_row(const uint8_t *w, int64_t k_dim, int64_t row, float *out) {
  const int64_t blocks = k_dim / F::BLOCK;
  const uint8_t *tile = w + row / TILE * blocks * F::TILE_BYTES;
  const int c = row % TILE / LANES, lane = row % LANES;
  for (int64_t b = 0; b < blocks; ++b)
    F::subs(tile + b * F::TILE_BYTES, c, [&](const auto &group, auto quants) {
      constexpr int N = group_size<std::decay_t<decltype(group)>>();
      quants([&](int i, const quant_of<decltype(group)> (&q)[N]) {
        vf weight[N];
        weights_of<F, N>(group.scale, group.offset, q, weight);
        for (int n = 0; n < N; ++n) out[b * F::BLOCK + group.s[n] * F::SUB + i] = weight[n][lane];
      });
    });
}

// Rows [row0, row0 + R) of tile j straight from its blocks, a vector of columns at a time (the
// tile's second pass reads it from the cache): each weight is dequantized once, in registers, for
// all R rows (R accumulators and the block's scales; 16 rows on AVX-512's 32 registers).
template <class F, int R>
inline void direct_rows(const float *x, int64_t k_dim, const uint8_t *w, const float *residual, float *out,
                        int64_t n_dim, int64_t row0, int64_t j) {
  const int64_t blocks = k_dim / F::BLOCK;
  const uint8_t *tile = w + j * blocks * F::TILE_BYTES;
  const float *xr = x + row0 * k_dim;
  for (int c = 0; c < VECTORS; ++c) {
    vf acc[R];
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) acc[r] = vf{};
    for (int64_t b = 0; b < blocks; ++b) {
      const uint8_t *block = tile + b * F::TILE_BYTES;
      if (c == 0) prefetch_block(block, F::TILE_BYTES);
      const float *xb = xr + b * F::BLOCK;
      F::subs(block, c, [&](const auto &group, auto quants) {
        constexpr int N = group_size<std::decay_t<decltype(group)>>();
        quants([&](int i, const quant_of<decltype(group)> (&q)[N]) {
#pragma GCC unroll 4
          for (int n = 0; n < N; ++n) {  // one weight in a register at a time, beside R accumulators
            const vf quant = to_float(q[n]);
            const vf weight = F::OFFSET ? group.scale[n] * quant + group.offset[n] : group.scale[n] * quant;
            const float *xk = xb + group.s[n] * F::SUB + i;
#pragma GCC unroll 16
            for (int r = 0; r < R; ++r) acc[r] += xk[r * k_dim] * weight;
          }
        });
      });
    }
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      store(out, residual, (row0 + r) * n_dim + j * TILE + c * LANES, acc[r]);
    }
  }
}

// Tile j of a product with weights in format F, for all m_dim rows. Decode reads its weights from
// memory every step (22-27 GB/s on the 2-core EPYC): a quantized format's 0.5-1 byte a weight
// instead of 4 is what makes a step of 16 rows fast.
// - Up to F::ROW_BY_ROW rows, row_tile, a row at a time (the second reads the tile from the cache).
// - Up to DIRECT_ROWS, straight from the blocks (direct_rows) in blocks of up to DIRECT_BLOCK rows:
//   a dequantized tile's stores and loads cost more than dequantizing each weight again per block.
//   The 30 Q4_1 layers' products from memory, 2 EPYC cores: 4 rows 10.1 -> 7.5 ms, 16 rows 19.9 ->
//   17.8, 32 rows 35.6 -> 34.2; the Q8_0 LM head: 4 rows 3.1 -> 1.6 ms, 16 rows 6.2 -> 5.2.
// - More: the tile dequantized whole (into this thread's buffer) and multiplied as float32 tiles
//   are. At 48 and 64 rows direct was 1-3% faster for the layers and 5-7% slower for the LM head.
constexpr int DIRECT_BLOCK = LANES == 16 ? 16 : 8;  // accumulators + the block's scales and weights
constexpr int64_t DIRECT_ROWS = 32;

template <class F>
inline void quantized_tile(const float *x, const uint8_t *w, const float *residual, float *out, int64_t m_dim,
                           int64_t k_dim, int64_t n_dim, int64_t j) {
  if (m_dim <= F::ROW_BY_ROW) {
    for (int64_t row = 0; row < m_dim; ++row) row_tile<F>(x, k_dim, w, residual, out, n_dim, row, j);
  } else if (m_dim <= DIRECT_ROWS) {
    equal_blocks(m_dim, DIRECT_BLOCK, [&](int64_t row, int64_t n) {
      with_rows<DIRECT_BLOCK>(n, [&](auto rows) {
        direct_rows<F, decltype(rows)::value>(x, k_dim, w, residual, out, n_dim, row, j);
      });
    });
  } else {
    thread_local std::vector<float> weights;
    weights.resize(k_dim * TILE);
    dequantize<F>(w, k_dim, j, weights.data());
    columns(x, weights.data(), residual, out, m_dim, k_dim, n_dim, j * TILE);
  }
}

}  // namespace packed
