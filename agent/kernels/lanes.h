// The vector of the packed products (packed_matmul.h) and the weight formats (formats/): LANES float32
// lanes of one register (AVX-512: 16; AArch64: 4, one NEON register; else 8 through GCC's vector
// extension: AVX2 registers, or two SSE registers on the portable x86 target), and the loads that
// fill it from a tile's bytes.
// A tile is TILE output columns; one of its rows is VECTORS vectors of LANES columns.
#pragma once

#include <cstdint>
#include <cstring>

#include "vec8.h"

namespace packed {

constexpr int TILE = 32;

#ifdef __AVX512F__
constexpr int LANES = 16;
#elif defined(__aarch64__) && defined(__ARM_NEON)
// GCC has no 32-byte vector mode on AArch64: 8 lanes are kept in memory, each operation loading and
// storing its halves (the products' accumulators on the stack); 4 are a NEON register. Not measured
// on Arm hardware: the assembly is what says so.
constexpr int LANES = 4;
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
#elif defined(__aarch64__) && defined(__ARM_NEON)
  uint32_t four;
  std::memcpy(&four, p, sizeof four);
  return (vi)vreinterpretq_s32_u32(vmovl_u16(vget_low_u16(vmovl_u8(vreinterpret_u8_u32(vdup_n_u32(four))))));
#else
  return vec8::widen(p);
#endif
}

inline vi widen_signed(const uint8_t *p) {
#ifdef __AVX512F__
  return (vi)_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i *>(p)));
#elif defined(__aarch64__) && defined(__ARM_NEON)
  uint32_t four;
  std::memcpy(&four, p, sizeof four);
  return (vi)vmovl_s16(vget_low_s16(vmovl_s8(vreinterpret_s8_u32(vdup_n_u32(four)))));
#else
  return vec8::widen_signed(p);
#endif
}

// Elements u..u + 3 of LANES columns (p: element u of a column vector; elements TILE bytes apart),
// lane t holding column t's four bytes, element u in its low byte: the formats' quants four k a
// column (formats/format.h quads), VPDPBUSD's layout, transposed in registers.
inline vi quad(const uint8_t *p) {
#if defined(__AVX512VBMI__) && defined(__AVX512BW__)
  // Two masked loads (elements u, u + 1 and u + 2, u + 3: bytes 0-15 and 32-47 of each; the masked
  // bytes are never read, so the last block of a matrix reads nothing past it), one byte permutation.
  constexpr __mmask64 ROWS_OF_16 = 0x0000FFFF0000FFFFull;
  const __m512i low = _mm512_maskz_loadu_epi8(ROWS_OF_16, p), high = _mm512_maskz_loadu_epi8(ROWS_OF_16, p + 2 * TILE);
  alignas(64) static constexpr uint8_t order[64] = {
#define COLUMN(t) t, 32 + t, 64 + t, 96 + t
      COLUMN(0), COLUMN(1), COLUMN(2),  COLUMN(3),  COLUMN(4),  COLUMN(5),  COLUMN(6),  COLUMN(7),
      COLUMN(8), COLUMN(9), COLUMN(10), COLUMN(11), COLUMN(12), COLUMN(13), COLUMN(14), COLUMN(15)};
#undef COLUMN
  return (vi)_mm512_permutex2var_epi8(low, _mm512_load_si512(order), high);
#elif defined(__AVX512F__)
  auto row = [&](int e) { return _mm_loadu_si128(reinterpret_cast<const __m128i *>(p + e * TILE)); };
  const __m128i a = _mm_unpacklo_epi8(row(0), row(1)), b = _mm_unpackhi_epi8(row(0), row(1));
  const __m128i c = _mm_unpacklo_epi8(row(2), row(3)), d = _mm_unpackhi_epi8(row(2), row(3));
  const __m256i low = _mm256_set_m128i(_mm_unpackhi_epi16(a, c), _mm_unpacklo_epi16(a, c));
  const __m256i high = _mm256_set_m128i(_mm_unpackhi_epi16(b, d), _mm_unpacklo_epi16(b, d));
  return (vi)_mm512_inserti64x4(_mm512_castsi256_si512(low), high, 1);
#elif defined(__AVX2__)
  auto row = [&](int e) { return _mm_loadl_epi64(reinterpret_cast<const __m128i *>(p + e * TILE)); };
  const __m128i a = _mm_unpacklo_epi8(row(0), row(1)), c = _mm_unpacklo_epi8(row(2), row(3));
  return (vi)_mm256_set_m128i(_mm_unpackhi_epi16(a, c), _mm_unpacklo_epi16(a, c));
#elif defined(__aarch64__) && defined(__ARM_NEON)
  // The four elements' 4 bytes side by side, transposed by one table lookup.
  uint32_t rows[4];
  for (int e = 0; e < 4; ++e) std::memcpy(&rows[e], p + e * TILE, sizeof rows[e]);
  static constexpr uint8_t order[16] = {0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15};
  return (vi)vreinterpretq_s32_u8(vqtbl1q_u8(vreinterpretq_u8_u32(vld1q_u32(rows)), vld1q_u8(order)));
#else
  return widen(p) | widen(p + TILE) << 8 | widen(p + 2 * TILE) << 16 | widen(p + 3 * TILE) << 24;
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
#elif defined(__aarch64__) && defined(__ARM_NEON)
  // FCVTL converts half denormals exactly (the kernels' threads flush nothing on Arm: thread_team.h).
  uint16_t bits[4];
  std::memcpy(bits, p, sizeof bits);
  return (vf)vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(bits)));
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
