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

#include "packed_matmul.h"
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

extern "C" int SkinnyMatMul(int nparam, void **params, int *ndims, int64_t **shapes,
                            const char **dtypes, void *stream, void *extra) {
  (void)stream; (void)extra; (void)dtypes;
  if (nparam != 3 || ndims[0] != 2 || ndims[1] != 3 || shapes[1][2] != packed::TILE) return 1;
  return multiply(static_cast<const float *>(params[0]), static_cast<const float *>(params[1]), nullptr,
                  static_cast<float *>(params[2]), shapes[0][0], shapes[0][1], shapes[1][0]);
}

// The same product added to a residual: inputs x [M, K], w [N / TILE, K, TILE], residual [M, N];
// output [M, N] = residual + x @ W (the layer's two residual adds, one op fewer each).
extern "C" int SkinnyMatMulAdd(int nparam, void **params, int *ndims, int64_t **shapes,
                               const char **dtypes, void *stream, void *extra) {
  (void)stream; (void)extra; (void)dtypes;
  if (nparam != 4 || ndims[0] != 2 || ndims[1] != 3 || ndims[2] != 2 || shapes[1][2] != packed::TILE ||
      shapes[2][0] != shapes[0][0] || shapes[2][1] != shapes[1][0] * packed::TILE)
    return 1;
  return multiply(static_cast<const float *>(params[0]), static_cast<const float *>(params[1]),
                  static_cast<const float *>(params[2]), static_cast<float *>(params[3]), shapes[0][0],
                  shapes[0][1], shapes[1][0]);
}

// The product with W as GGUF Q8_0 blocks (packed_matmul.h q8): inputs x [M, K] float32, w [N / TILE,
// K / 32, q8::TILE_BYTES] uint8; output [M, N] float32. The LM head of a Q8_0 embedding.
extern "C" int SkinnyMatMulQ8(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes,
                              void *stream, void *extra) {
  (void)stream; (void)extra; (void)dtypes;
  if (nparam != 3 || ndims[0] != 2 || ndims[1] != 3 || shapes[1][2] != q8::TILE_BYTES ||
      shapes[1][1] * q8::BLOCK != shapes[0][1])
    return 1;
  const float *x = static_cast<const float *>(params[0]);
  const uint8_t *w = static_cast<const uint8_t *>(params[1]);
  float *out = static_cast<float *>(params[2]);
  const int64_t m_dim = shapes[0][0], k_dim = shapes[0][1], tiles = shapes[1][0];
  team::Team::instance().run([&](team::Region &region) {
    region.for_dynamic(tiles, 2, [&](int64_t j) {
      q8::tile(x, w, nullptr, out, m_dim, k_dim, tiles * packed::TILE, j);
    });
  });
  return 0;
}
