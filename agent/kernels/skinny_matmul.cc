// out[M, N] = x[M, K] @ W for the few rows a decode step has (M = batch size), with W packed at load
// time (packed_matmul.h). MindSpore's CPU MatMul reaches 5-9 GB/s of weights on such skinny
// products; this reaches 9-18 GB/s (measured on the model's shapes: 30 layers at M = 16 in 47 ms
// against 70 ms, at M = 1 in 24 ms against 31 ms).
//
// MindSpore AOT custom-op interface (CPU): inputs x [M, K], w [N / TILE, K, TILE], float32;
// output [M, N]. Columns are split over the kernels' thread team (thread_team.h: a thread per CPU
// this process may use), in small dynamic chunks so a core taken by another process delays the
// product little.
#include <cstdint>
#include <vector>

#include "entry.h"
#include "int8_products.h"
#include "product.h"
#include "thread_team.h"

namespace {

int multiply(const float *x, const float *w, const float *residual, float *out, int64_t m_dim,
             int64_t k_dim, int64_t tiles) {
  team::Team::instance().run([&](team::Region &region) {
    region.for_dynamic(tiles, 2, [&](int64_t j) {
      packed::tile(x, w, residual, out, m_dim, k_dim, tiles * packed::TILE, j);
    });
  });
  return 0;
}

}  // namespace

KERNEL_ENTRY int SkinnyMatMul(int nparam, void **params, int *ndims, int64_t **shapes,
                            const char **dtypes, void *stream, void *extra) {
  (void)stream; (void)extra; (void)dtypes;
  if (nparam != 3 || ndims[0] != 2 || ndims[1] != 3 || shapes[1][2] != packed::TILE) return 1;
  return multiply(static_cast<const float *>(params[0]), static_cast<const float *>(params[1]), nullptr,
                  static_cast<float *>(params[2]), shapes[0][0], shapes[0][1], shapes[1][0]);
}

// The same product added to a residual: inputs x [M, K], w [N / TILE, K, TILE], residual [M, N];
// output [M, N] = residual + x @ W (the layer's two residual adds, one op fewer each).
KERNEL_ENTRY int SkinnyMatMulAdd(int nparam, void **params, int *ndims, int64_t **shapes,
                               const char **dtypes, void *stream, void *extra) {
  (void)stream; (void)extra; (void)dtypes;
  if (nparam != 4 || ndims[0] != 2 || ndims[1] != 3 || ndims[2] != 2 || shapes[1][2] != packed::TILE ||
      shapes[2][0] != shapes[0][0] || shapes[2][1] != shapes[1][0] * packed::TILE)
    return 1;
  return multiply(static_cast<const float *>(params[0]), static_cast<const float *>(params[1]),
                  static_cast<const float *>(params[2]), static_cast<float *>(params[3]), shapes[0][0],
                  shapes[0][1], shapes[1][0]);
}

namespace {

// The inputs of a product call in a weight format (x, w, format; out): the matrix, false where the
// shapes do not fit.
bool read_format_call(int nparam, void **params, int *ndims, int64_t **shapes, product::Matrix &m) {
  return nparam == 4 && ndims[0] == 2 && ndims[2] == 1 &&
         product::read_matrix(params[1], *static_cast<const int32_t *>(params[2]), ndims[1], shapes[1], m) &&
         m.k_dim == shapes[0][1];
}

}  // namespace

// The product with W in a weight format (product.h): inputs x [M, K] float32, w (packed: F32
// [N / TILE, K, TILE] float32, else [N / TILE, K / BLOCK, TILE_BYTES] uint8), format [1] int32;
// output [M, N] float32. The LM head of a GGUF (its own format, or the tied embedding's).
KERNEL_ENTRY int SkinnyMatMulFormat(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes,
                                  void *stream, void *extra) {
  (void)stream; (void)extra; (void)dtypes;
  product::Matrix m;
  if (!read_format_call(nparam, params, ndims, shapes, m)) return 1;
  const float *x = static_cast<const float *>(params[0]);
  float *out = static_cast<float *>(params[3]);
  const int64_t m_dim = shapes[0][0];
  team::Team::instance().run([&](team::Region &region) {
    region.for_dynamic(m.tiles, 2, [&](int64_t j) { product::tile(m, x, nullptr, out, m_dim, m.n_dim(), j); });
  });
  return 0;
}

// SkinnyMatMulFormat with int8 activations (int8_products.h): x's rows quantized per block of 32,
// then the products (F16, BF16 and F32 weights as float32). The int8 products called alone (the
// fused layer's under runtime.activations int8); refused (1) without them.
KERNEL_ENTRY int SkinnyMatMulFormatI8(int nparam, void **params, int *ndims, int64_t **shapes,
                                    const char **dtypes, void *stream, void *extra) {
  (void)stream; (void)extra; (void)dtypes;
  product::Matrix m;
  if (!int8::AVAILABLE || !read_format_call(nparam, params, ndims, shapes, m) || m.k_dim % int8::XBLOCK != 0)
    return 1;
  const float *x = static_cast<const float *>(params[0]);
  float *out = static_cast<float *>(params[3]);
  const int64_t m_dim = shapes[0][0];
  std::vector<int8_t> q(m_dim * m.k_dim);
  std::vector<float> d(m_dim * m.k_dim / int8::XBLOCK), s(m_dim * m.k_dim / int8::XSUM);
  const int8::Rows rows{q.data(), d.data(), s.data(), m.k_dim};
  for (int64_t row = 0; row < m_dim; ++row) int8::quantize_row(rows, x, row);
  team::Team::instance().run([&](team::Region &region) {
    region.for_dynamic(m.tiles, 2, [&](int64_t j) {
      if (!int8::tile(m, rows, nullptr, out, m_dim, m.n_dim(), j)) product::tile(m, x, nullptr, out, m_dim, m.n_dim(), j);
    });
  });
  return 0;
}

// Rows of a matrix in a weight format, as float32: an embedding lookup that reads only the rows it
// needs (a GGUF's token embedding stays in its format; when tied it is also the LM head, one copy).
// Inputs ids [N] int32, w and format as SkinnyMatMulFormat's (rows are its output columns); output
// [N, K] float32. An id outside the matrix's rows is refused (returns 1).
KERNEL_ENTRY int MatrixRows(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes,
                          void *stream, void *extra) {
  (void)stream; (void)extra; (void)dtypes;
  product::Matrix m;
  if (nparam != 4 || ndims[0] != 1 || ndims[2] != 1 || ndims[3] != 2 ||
      !product::read_matrix(params[1], *static_cast<const int32_t *>(params[2]), ndims[1], shapes[1], m) ||
      shapes[3][0] != shapes[0][0] || shapes[3][1] != m.k_dim)
    return 1;
  const int32_t *ids = static_cast<const int32_t *>(params[0]);
  float *out = static_cast<float *>(params[3]);
  const int64_t n = shapes[0][0];
  for (int64_t i = 0; i < n; ++i)
    if (ids[i] < 0 || ids[i] >= m.n_dim()) return 1;
  for (int64_t i = 0; i < n; ++i) product::matrix_row(m, ids[i], out + i * m.k_dim);
  return 0;
}
