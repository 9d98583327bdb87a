// The layer's row-wise elementwise steps as one kernel each instead of several MindSpore ops: on CPU
// each op costs about 20 us of dispatch beside its few us of work, and a decode step ran ~1000 ops.
// MindSpore AOT custom-op interface (CPU), float32.
#include <cstdint>

#include "entry.h"
#include "row_ops.h"

// RMSNorm of each row (six ops: square, mean, add, rsqrt, two multiplies; 61 norms a step):
// inputs x [M, D], w [D], eps [1]; output [M, D] = x / sqrt(mean(x^2) + eps) * w.
KERNEL_ENTRY int RmsNorm(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes,
                       void *stream, void *extra) {
  (void)stream; (void)extra; (void)dtypes;
  if (nparam != 4 || ndims[0] != 2 || ndims[1] != 1 || shapes[1][0] != shapes[0][1]) return 1;
  const float *x = static_cast<const float *>(params[0]);
  const float *w = static_cast<const float *>(params[1]);
  const float eps = *static_cast<const float *>(params[2]);
  float *out = static_cast<float *>(params[3]);
  const int64_t rows = shapes[0][0], dim = shapes[0][1];
  for (int64_t m = 0; m < rows; ++m) rowwise::rms_norm(x + m * dim, w, eps, dim, out + m * dim);
  return 0;
}

// SwiGLU (four ops: split, sigmoid, two multiplies): input gate_up [M, 2F] (gate columns, then up);
// output [M, F] = silu(gate) * up.
KERNEL_ENTRY int SwiGlu(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes,
                      void *stream, void *extra) {
  (void)stream; (void)extra; (void)dtypes;
  if (nparam != 2 || ndims[0] != 2 || shapes[0][1] % 2 != 0) return 1;
  const float *x = static_cast<const float *>(params[0]);
  float *out = static_cast<float *>(params[1]);
  const int64_t rows = shapes[0][0], width = shapes[0][1] / 2;
  for (int64_t m = 0; m < rows; ++m) {
    const float *gate = x + m * 2 * width;
    rowwise::swiglu(gate, gate + width, width, out + m * width);
  }
  return 0;
}

// RoPE on the fused QKV projection (ten ops: splits, reshapes, the rotate-half product, two
// multiplies, an add): input qkv [N, (Q + 2 KV) * hd] (Q query heads, KV key heads, KV value heads),
// cos [N, 1, hd], sin [N, 1, hd] with the rotate-half sign folded in (first half negative),
// kv [1] int32 = KV; output [N, Q + 2 KV, hd]: query and key heads rotated, value heads copied.
KERNEL_ENTRY int Rope(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes,
                    void *stream, void *extra) {
  (void)stream; (void)extra; (void)dtypes;
  if (nparam != 5 || ndims[0] != 2 || ndims[1] != 3 || ndims[4] != 3) return 1;
  const float *qkv = static_cast<const float *>(params[0]);
  const float *cos = static_cast<const float *>(params[1]);
  const float *sin = static_cast<const float *>(params[2]);
  const int64_t kv = *static_cast<const int32_t *>(params[3]);
  float *out = static_cast<float *>(params[4]);
  const int64_t rows = shapes[4][0], heads = shapes[4][1], hd = shapes[4][2];
  const int64_t rotated = heads - kv;  // query and key heads
  for (int64_t n = 0; n < rows; ++n) {
    const float *c = cos + n * hd;
    const float *s = sin + n * hd;
    for (int64_t h = 0; h < heads; ++h) {
      const float *x = qkv + (n * heads + h) * hd;
      float *o = out + (n * heads + h) * hd;
      if (h < rotated) rowwise::rope(x, c, s, hd, o);
      else std::memcpy(o, x, sizeof(float) * hd);
    }
  }
  return 0;
}
