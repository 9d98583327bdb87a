// The rows of a paged KV cache (one position of one KV head each), in either format of
// runtime.kv_cache_dtype: float32 (head_dim floats) or q8_0 (head_dim / 32 blocks of llama.cpp's
// Q8_0: a half scale d, then 32 int8 quants q; value = d * q), so that a q8_0 row is the GGUF Q8_0
// encoding of the float row (gguf.quants.quantize is the tests' reference). Which one a cache is
// follows from its width against the head dim: hd floats, or hd / 32 * 34 bytes.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace kvrows {

constexpr int64_t Q8_BLOCK = 32, Q8_BYTES = 34;

// float -> IEEE half, rounded to nearest even (numpy's astype(float16)); integer arithmetic only, so
// that no compiler flag or FPU mode changes it.
inline uint16_t float_to_half(float f) {
  uint32_t x;
  std::memcpy(&x, &f, sizeof x);
  const uint32_t sign = (x >> 16) & 0x8000, mag = x & 0x7fffffff;
  if (mag > 0x7f800000) return static_cast<uint16_t>(sign | 0x7e00);  // NaN
  if (mag >= 0x477ff000) return static_cast<uint16_t>(sign | 0x7c00);  // >= 65520 rounds to infinity
  uint32_t h, rest, halfway;
  if (mag < 0x38800000) {  // below 2^-14: a half subnormal, in units of 2^-24
    const uint32_t exponent = mag >> 23;
    if (exponent < 102) return static_cast<uint16_t>(sign);  // below 2^-25: zero
    const uint32_t mantissa = (mag & 0x7fffff) | 0x800000, shift = 126 - exponent;  // 14 .. 24
    h = mantissa >> shift, rest = mantissa & ((1u << shift) - 1), halfway = 1u << (shift - 1);
  } else {
    h = (mag - 0x38000000) >> 13, rest = mag & 0x1fff, halfway = 0x1000;
  }
  if (rest > halfway || (rest == halfway && (h & 1))) ++h;  // a carry moves into the exponent, as it should
  return static_cast<uint16_t>(sign | h);
}

inline float half_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000) << 16, exponent = (h >> 10) & 0x1f, mantissa = h & 0x3ff;
  if (exponent == 0) {
    const float f = static_cast<float>(mantissa) * (1.f / 16777216.f);  // mantissa * 2^-24, a float normal
    return sign ? -f : f;
  }
  const uint32_t bits = sign | (exponent == 31 ? 0x7f800000 | (mantissa << 13) : ((exponent + 112) << 23) | (mantissa << 13));
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// One cache (a K or a V of one layer): its bytes, each row's bytes, and its format.
struct Cache {
  uint8_t *data = nullptr;
  int64_t row_bytes = 0;
  bool q8 = false;

  // The cache of `width` elements a row (its last dimension) for a head dim of hd; false where the
  // width is neither format's.
  static bool of(void *data, int64_t width, int64_t hd, Cache &cache) {
    cache.data = static_cast<uint8_t *>(data);
    if (hd <= 0) return false;
    if (width == hd) {
      cache.q8 = false, cache.row_bytes = hd * static_cast<int64_t>(sizeof(float));
      return true;
    }
    if (hd % Q8_BLOCK == 0 && width == hd / Q8_BLOCK * Q8_BYTES) {
      cache.q8 = true, cache.row_bytes = width;
      return true;
    }
    return false;
  }

  uint8_t *row(int64_t r) const { return data + r * row_bytes; }
};

// Row r <- x [hd]: copied, or quantized as llama.cpp's quantize_row_q8_0_ref (d = max |x| / 127 stored as
// a half, q = round(x / d) half away from zero with the float d, 0 for a block of zeros).
inline void store(const Cache &cache, int64_t r, const float *x, int64_t hd) {
  uint8_t *to = cache.row(r);
  if (!cache.q8) {
    std::memcpy(to, x, sizeof(float) * hd);
    return;
  }
  for (int64_t b = 0; b < hd / Q8_BLOCK; ++b, to += Q8_BYTES) {
    const float *in = x + b * Q8_BLOCK;
    float amax = 0.f;
    for (int64_t i = 0; i < Q8_BLOCK; ++i) amax = std::max(amax, std::fabs(in[i]));
    const float d = amax / 127.f, inverse = d != 0.f ? 1.f / d : 0.f;
    const uint16_t half = float_to_half(d);
    std::memcpy(to, &half, sizeof half);
    int8_t *q = reinterpret_cast<int8_t *>(to + 2);
#pragma omp simd
    for (int64_t i = 0; i < Q8_BLOCK; ++i) q[i] = static_cast<int8_t>(std::round(in[i] * inverse));
  }
}

// Rows r .. r + n - 1 as floats [n, hd]: the cache's own (float32) or dequantized into `scratch`.
inline const float *rows(const Cache &cache, int64_t r, int64_t n, int64_t hd, float *scratch) {
  if (!cache.q8) return reinterpret_cast<const float *>(cache.row(r));
  const uint8_t *from = cache.row(r);
  for (int64_t b = 0; b < n * hd / Q8_BLOCK; ++b, from += Q8_BYTES) {
    uint16_t half;
    std::memcpy(&half, from, sizeof half);
    const float d = half_to_float(half);
    const int8_t *q = reinterpret_cast<const int8_t *>(from + 2);
    float *out = scratch + b * Q8_BLOCK;
#pragma omp simd
    for (int64_t i = 0; i < Q8_BLOCK; ++i) out[i] = d * static_cast<float>(q[i]);
  }
  return scratch;
}

}  // namespace kvrows
