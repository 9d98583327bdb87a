// out[M, N] = x[M, K] @ W for the few rows a decode step has (M = batch size), with W packed at load
// time as [N / TILE, K, TILE]: each tile of TILE output columns is one contiguous stream, read
// once per block of ROWS rows while ROWS x TILE accumulators stay in registers. MindSpore's CPU
// MatMul reaches 5-9 GB/s of weights on such skinny products; this reaches 9-18 GB/s (measured on
// the model's shapes: 30 layers at M = 16 in 47 ms against 70 ms, at M = 1 in 24 ms against 31 ms).
//
// MindSpore AOT custom-op interface (CPU): inputs x [M, K], w [N / TILE, K, TILE], float32;
// output [M, N]. Columns are split over one OpenMP thread per CPU this process may use, in small
// dynamic chunks so a core taken by another process delays the product little. The agent sets
// OMP_WAIT_POLICY=PASSIVE: idle workers sleep instead of spinning on MindSpore's cores.
#include <cstdint>

#include "usable_cpus.h"

namespace {

constexpr int TILE = 32;
constexpr int ROWS = 8;  // 8 x 32 accumulators: 16 AVX-512 or 32 AVX2 registers' worth

template <int R>
void tile_rows(const float *x, int64_t k_dim, const float *w_tile, const float *residual, float *out,
               int64_t n_dim, int64_t row0, int64_t col0) {
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

int multiply(const float *x, const float *w, const float *residual, float *out, int64_t m_dim,
             int64_t k_dim, int64_t tiles) {
  const int64_t n_dim = tiles * TILE;
  static const int threads = usable_cpus();
#pragma omp parallel for schedule(dynamic, 2) num_threads(threads)
  for (int64_t j = 0; j < tiles; ++j) {
    const float *w_tile = w + j * k_dim * TILE;
    const int64_t col = j * TILE;
    int64_t row = 0;
    for (; row + ROWS <= m_dim; row += ROWS) tile_rows<ROWS>(x, k_dim, w_tile, residual, out, n_dim, row, col);
    if (row + 4 <= m_dim) { tile_rows<4>(x, k_dim, w_tile, residual, out, n_dim, row, col); row += 4; }
    if (row + 2 <= m_dim) { tile_rows<2>(x, k_dim, w_tile, residual, out, n_dim, row, col); row += 2; }
    if (row < m_dim) tile_rows<1>(x, k_dim, w_tile, residual, out, n_dim, row, col);
  }
  return 0;
}

}  // namespace

extern "C" int SkinnyMatMul(int nparam, void **params, int *ndims, int64_t **shapes,
                            const char **dtypes, void *stream, void *extra) {
  (void)stream; (void)extra; (void)dtypes;
  if (nparam != 3 || ndims[0] != 2 || ndims[1] != 3 || shapes[1][2] != TILE) return 1;
  return multiply(static_cast<const float *>(params[0]), static_cast<const float *>(params[1]), nullptr,
                  static_cast<float *>(params[2]), shapes[0][0], shapes[0][1], shapes[1][0]);
}

// The same product added to a residual: inputs x [M, K], w [N / TILE, K, TILE], residual [M, N];
// output [M, N] = residual + x @ W (the layer's two residual adds, one op fewer each).
extern "C" int SkinnyMatMulAdd(int nparam, void **params, int *ndims, int64_t **shapes,
                               const char **dtypes, void *stream, void *extra) {
  (void)stream; (void)extra; (void)dtypes;
  if (nparam != 4 || ndims[0] != 2 || ndims[1] != 3 || ndims[2] != 2 || shapes[1][2] != TILE ||
      shapes[2][0] != shapes[0][0] || shapes[2][1] != shapes[1][0] * TILE)
    return 1;
  return multiply(static_cast<const float *>(params[0]), static_cast<const float *>(params[1]),
                  static_cast<const float *>(params[2]), static_cast<float *>(params[3]), shapes[0][0],
                  shapes[0][1], shapes[1][0]);
}
