// Eight lanes in one vector register (GCC/Clang vector extension: AVX on this machine, two SSE
// or NEON registers elsewhere), and the loads the kernels need; shared by row_ops.h and packed_matmul.h.
#pragma once

#include <cstdint>
#include <cstring>
#ifdef __AVX__
#include <immintrin.h>
#endif
#if defined(__aarch64__) && defined(__ARM_NEON)
#include <arm_neon.h>
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

#if defined(__aarch64__) && defined(__ARM_NEON)
// The halves of v added (lane i: v[i] + v[i + 4]): the first step of sum's order.
inline float32x4_t folded(const v8f &v) {
  const float *lanes = reinterpret_cast<const float *>(&v);
  return vaddq_f32(vld1q_f32(lanes), vld1q_f32(lanes + 4));
}
#endif

inline float sum(v8f v) {
#if defined(__aarch64__) && defined(__ARM_NEON)
  // the same order in pairwise adds: (t0 + t1) + (t2 + t3), t = folded(v)
  const float32x4_t t = folded(v);
  return vpadds_f32(vget_low_f32(vpaddq_f32(t, t)));
#else
  return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7]));
#endif
}

// The sums of eight vectors, as one vector (a transposing add tree: 7 instructions against 8 sums'
// ~40).
inline v8f sums(const v8f *v) {
#ifdef __AVX__
  const __m256 a = _mm256_hadd_ps((__m256)v[0], (__m256)v[1]), b = _mm256_hadd_ps((__m256)v[2], (__m256)v[3]);
  const __m256 c = _mm256_hadd_ps((__m256)v[4], (__m256)v[5]), d = _mm256_hadd_ps((__m256)v[6], (__m256)v[7]);
  const __m256 low = _mm256_hadd_ps(a, b), high = _mm256_hadd_ps(c, d);  // lanes 0-3 and 4-7 of each sum
  return (v8f)_mm256_add_ps(_mm256_permute2f128_ps(low, high, 0x20), _mm256_permute2f128_ps(low, high, 0x31));
#elif defined(__aarch64__) && defined(__ARM_NEON)
  // sum(v[j]) for each j, in sum's order (bit for bit the scalar fallback's): pairwise adds of the
  // folded halves, twice.
  float32x4_t t[8];
  for (int j = 0; j < 8; ++j) t[j] = folded(v[j]);
  const float32x4_t low = vpaddq_f32(vpaddq_f32(t[0], t[1]), vpaddq_f32(t[2], t[3]));
  const float32x4_t high = vpaddq_f32(vpaddq_f32(t[4], t[5]), vpaddq_f32(t[6], t[7]));
  v8f out;
  std::memcpy(&out, &low, sizeof low);
  std::memcpy(reinterpret_cast<float *>(&out) + 4, &high, sizeof high);
  return out;
#else
  v8f out;
  for (int j = 0; j < 8; ++j) out[j] = sum(v[j]);
  return out;
#endif
}

}  // namespace vec8
