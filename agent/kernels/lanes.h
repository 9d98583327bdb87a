// The vector of the packed products (packed_matmul.h) and the weight formats (formats/): LANES float32
// lanes of one register (AVX-512: 16, else 8 through GCC's vector extension: AVX2 registers, or two
// SSE/NEON registers on the portable target), and the loads that fill it from a tile's bytes.
// A tile is TILE output columns; one of its rows is VECTORS vectors of LANES columns.
#pragma once

#include <cstdint>
#include <cstring>

#include "vec8.h"

namespace packed {

constexpr int TILE = 32;

#ifdef __AVX512F__
constexpr int LANES = 16;
#else
constexpr int LANES = 8;
#endif
constexpr int VECTORS = TILE / LANES;
typedef float vf __attribute__((vector_size(LANES * sizeof(float))));
typedef int32_t vi __attribute__((vector_size(LANES * sizeof(int32_t))));

inline vf to_float(vi v) { return __builtin_convertvector(v, vf); }
inline vf to_float(vf v) { return v; }  // F16 and BF16 quants (formats/format.h Group::Quant)

inline vf broadcast(float value) { return vf{} + value; }

// LANES bytes widened to LANES int32, unsigned and signed: the dequantizers' loads, a whole register
// at a time (on AVX-512, 16 lanes instead of 8: 30 layers at batch 16, 27.1 -> 26.0 ms in one process).
inline vi widen(const uint8_t *p) {
#ifdef __AVX512F__
  return (vi)_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i *>(p)));
#else
  return vec8::widen(p);
#endif
}

inline vi widen_signed(const uint8_t *p) {
#ifdef __AVX512F__
  return (vi)_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i *>(p)));
#else
  return vec8::widen_signed(p);
#endif
}

// LANES uint32 (Q5's high bits: one 32-bit mask a column).
inline vi load_u32(const uint8_t *p) {
  vi v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// LANES uint16 widened to int32.
inline vi widen_u16(const uint8_t *p) {
  typedef uint16_t vh __attribute__((vector_size(LANES * sizeof(uint16_t))));
  vh h;
  std::memcpy(&h, p, sizeof h);
  return __builtin_convertvector(h, vi);
}

// LANES IEEE half floats (the files' scales, F16 weights) as float32, exactly. F16C converts in
// one instruction (and ignores denormals-are-zero, which the kernels' threads set: a file's scale
// may be a half denormal); elsewhere from the bits, denormals through an integer conversion so that
// no float32 denormal is ever an operand. Infinities and NaNs do not occur in weights.
inline vf load_half(const uint8_t *p) {
#if defined(__AVX512F__)
  return (vf)_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i *>(p)));
#elif defined(__F16C__)
  return (vf)_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i *>(p)));
#else
  const vi h = widen_u16(p);
  const vi magnitude = h & 0x7fff, sign = (h & 0x8000) << 16;
  const vi normal = (magnitude << 13) + ((127 - 15) << 23);
  const vi subnormal = (vi)(to_float(magnitude) * (1.f / 16777216.f));  // mantissa * 2^-24
  return (vf)((magnitude < 0x400 ? subnormal : normal) | sign);
#endif
}

// LANES bfloat16 as float32 (the upper half of a float32's bits).
inline vf load_bf16(const uint8_t *p) { return (vf)(widen_u16(p) << 16); }

}  // namespace packed
