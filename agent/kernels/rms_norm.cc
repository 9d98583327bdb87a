// RMSNorm of each row: out[m, :] = x[m, :] / sqrt(mean(x[m, :]^2) + eps) * w. One kernel instead of
// the six MindSpore ops (square, mean, add, rsqrt, two multiplies) each norm takes otherwise: a
// decode step has 61 norms, and on CPU each op costs about 20 us of dispatch beside its few us of work.
//
// MindSpore AOT custom-op interface (CPU): inputs x [M, D], w [D], eps [1]; output [M, D]; float32.
#include <cmath>
#include <cstdint>

extern "C" int RmsNorm(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes,
                       void *stream, void *extra) {
  (void)stream; (void)extra; (void)dtypes;
  if (nparam != 4 || ndims[0] != 2 || ndims[1] != 1 || shapes[1][0] != shapes[0][1]) return 1;
  const float *x = static_cast<const float *>(params[0]);
  const float *w = static_cast<const float *>(params[1]);
  const float eps = *static_cast<const float *>(params[2]);
  float *out = static_cast<float *>(params[3]);
  const int64_t rows = shapes[0][0], dim = shapes[0][1];
  for (int64_t m = 0; m < rows; ++m) {
    const float *row = x + m * dim;
    float squares = 0.f;
#pragma omp simd reduction(+ : squares)
    for (int64_t d = 0; d < dim; ++d) squares += row[d] * row[d];
    const float scale = 1.f / std::sqrt(squares / static_cast<float>(dim) + eps);
    float *o = out + m * dim;
#pragma omp simd
    for (int64_t d = 0; d < dim; ++d) o[d] = row[d] * scale * w[d];
  }
  return 0;
}
