// Eight lanes in one vector register (GCC/Clang vector extension: AVX on this machine, two SSE
// registers elsewhere), and the loads the kernels need; shared by row_ops.h and packed_matmul.h.
#pragma once

#include <cstdint>
#include <cstring>
#ifdef __AVX__
#include <immintrin.h>
#endif

namespace vec8 {

typedef float v8f __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));

inline v8f load(const float *p) {
  v8f v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// Eight bytes widened to eight int32 (GCC's generic conversion of a byte vector goes byte by byte).
inline v8i widen(const uint8_t *p) {
#ifdef __AVX2__
  return (v8i)_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i *>(p)));
#else
  typedef uint8_t v8u8 __attribute__((vector_size(8)));
  v8u8 bytes;
  std::memcpy(&bytes, p, sizeof bytes);
  return __builtin_convertvector(bytes, v8i);
#endif
}

// Eight int8 widened to eight int32.
inline v8i widen_signed(const uint8_t *p) {
#ifdef __AVX2__
  return (v8i)_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i *>(p)));
#else
  typedef int8_t v8s8 __attribute__((vector_size(8)));
  v8s8 bytes;
  std::memcpy(&bytes, p, sizeof bytes);
  return __builtin_convertvector(bytes, v8i);
#endif
}

inline float sum(v8f v) { return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7])); }

// The sums of eight vectors, as one vector (a transposing add tree: 7 instructions against 8 sums'
// ~40).
inline v8f sums(const v8f *v) {
#ifdef __AVX__
  const __m256 a = _mm256_hadd_ps((__m256)v[0], (__m256)v[1]), b = _mm256_hadd_ps((__m256)v[2], (__m256)v[3]);
  const __m256 c = _mm256_hadd_ps((__m256)v[4], (__m256)v[5]), d = _mm256_hadd_ps((__m256)v[6], (__m256)v[7]);
  const __m256 low = _mm256_hadd_ps(a, b), high = _mm256_hadd_ps(c, d);  // lanes 0-3 and 4-7 of each sum
  return (v8f)_mm256_add_ps(_mm256_permute2f128_ps(low, high, 0x20), _mm256_permute2f128_ps(low, high, 0x31));
#else
  v8f out;
  for (int j = 0; j < 8; ++j) out[j] = sum(v[j]);
  return out;
#endif
}

}  // namespace vec8
