// Opt-in (runtime.activations: int8): the products of every integer weight format (formats/*.h, all
// but F16 and BF16) at every row count, with the activations quantized per block of 32 as llama.cpp's
// Q8_1 does: x[k] ~ dx * qx[k] (qx int8, dx = max |x| / 127). The weights' quants are taken four k a
// column (VPDPBUSD's layout): up to DIRECT_ROWS rows straight from the blocks (formats/format.h
// quads), above that from a copy of the tile unpacked once a call. Per sub-block, sum_k x[k] w[k][t]
// ~ scale[t] * dx * sum_k qx[k] q[k][t] + offset[t] * sx (sx = dx * the sub-block's sum of qx), the
// integer sums by AVX512-VNNI's VPDPBUSD (64 byte products an instruction against a float FMA's 16),
// AVX2's VPMADDUBSW + VPMADDWD (32 in two), or on AArch64 SDOT (16 in one, __ARM_FEATURE_DOTPROD;
// SMMLA's 32 for the unpacked tile's pairs of rows where __ARM_FEATURE_MATMUL_INT8) or else SMULL +
// SADALP (16 in four, plain NEON). The weights stay exactly the file's; only the activations are
// rounded, so answers may differ from the float32 products'. The Arm paths are tested under qemu
// (tests/unit/agent/test_arm_kernels.py), never measured on Arm hardware.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "product.h"
#if defined(__aarch64__) && defined(__ARM_NEON)
#include <arm_neon.h>
#endif

namespace int8 {

// The 30 Q4_1 layers of a decode step at context 160 (tools.model_bench, the 2-core EPYC), float32 ->
// int8 (an unpacked tile): 8 rows 18.1 -> 15.2 ms, 16 rows 30.9 -> 24.2, 32 rows 58.5 -> 41.8; a
// 1024-token prompt 1308 -> 670.
constexpr int XBLOCK = 32;  // activations a scale
constexpr int XSUM = 16;    // activations a sum: the smallest sub-block (Q2_K, Q3_K, Q6_K)

// The largest quant of an unsigned format (its bits): it bounds AVX2's 16-bit sums.
constexpr int max_quant(int32_t id) {
  switch (id) {
    case formats::Q2_K::ID: return 3;
    case formats::Q3_K::ID: return 7;
    case formats::Q4_0::ID: case formats::Q4_1::ID: case formats::Q4_K::ID: return 15;
    case formats::Q5_0::ID: case formats::Q5_1::ID: case formats::Q5_K::ID: return 31;
    case formats::Q6_K::ID: return 63;
    default: return 255;
  }
}

// Whether a format's products take int8 activations, the bias that makes its quants bytes (Q8_0's
// int8 quants + 128; the others' are unsigned already), and the largest magnitude AVX2 multiplies
// (Q8_0's signed quants: 128).
template <class F>
struct Traits {
  static constexpr bool USABLE = true;
  static constexpr int BIAS = 0;
  static constexpr int MAX_QUANT = max_quant(F::ID);
};
template <>
struct Traits<formats::Q8_0> {
  static constexpr bool USABLE = true;
  static constexpr int BIAS = 128;
  static constexpr int MAX_QUANT = 128;
};
template <>
struct Traits<formats::F16> {
  static constexpr bool USABLE = false;
  static constexpr int BIAS = 0;
  static constexpr int MAX_QUANT = 0;
};
template <>
struct Traits<formats::BF16> {
  static constexpr bool USABLE = false;
  static constexpr int BIAS = 0;
  static constexpr int MAX_QUANT = 0;
};

// Rows of activations quantized: q [M, K] int8, d [M, K / XBLOCK] and s [M, K / XSUM] (d * sum q).
struct Rows {
  int8_t *q;
  float *d, *s;
  int64_t k_dim;
};

// Row `row` of `in` [M, k_dim] quantized into x (k_dim a multiple of XBLOCK): rounded to nearest,
// ties to even, as the reference (tests/support/reference_numpy.py q8_1) rounds.
inline void quantize_row(const Rows &x, const float *in, int64_t row) {
  const float *xr = in + row * x.k_dim;
  int8_t *q = x.q + row * x.k_dim;
  const int64_t blocks = x.k_dim / XBLOCK;
  for (int64_t b = 0; b < blocks; ++b) {
    float amax = 0.f;
#pragma omp simd reduction(max : amax)
    for (int i = 0; i < XBLOCK; ++i) amax = std::max(amax, std::fabs(xr[b * XBLOCK + i]));
    const float d = amax / 127.f, inverse = amax > 0.f ? 127.f / amax : 0.f;
    x.d[row * blocks + b] = d;
    for (int h = 0; h < XBLOCK / XSUM; ++h) {
      const int64_t at = b * XBLOCK + h * XSUM;
      int32_t total = 0;
#pragma omp simd reduction(+ : total)
      for (int i = 0; i < XSUM; ++i) {
        const int32_t v = static_cast<int32_t>(std::nearbyint(xr[at + i] * inverse));
        q[at + i] = static_cast<int8_t>(v);
        total += v;
      }
      x.s[row * (x.k_dim / XSUM) + at / XSUM] = d * static_cast<float>(total);
    }
  }
}

// A tile unpacked: bytes [K / 4][TILE][4] (byte (t, kk) of group g = quant k = 4 g + kk of column
// t, plus the format's bias where the dot products take unsigned bytes: BIASED), each sub-block's scale and offset [K / SUB][TILE], and the order in
// which the format visits a block's sub-blocks (formats/*.h subs: Q2_K, Q3_K and Q6_K's 0, 2, 4, 6,
// 1, 3, ...), the order the rows sum them in, as straight from the blocks: a row's float sums are then
// the same at every row count (batch invariance).
struct Unpacked {
  std::vector<packed::vi> bytes;  // aligned vectors of four k of LANES columns
  const uint8_t *at(int64_t offset) const { return reinterpret_cast<const uint8_t *>(bytes.data()) + offset; }
  std::vector<float> scale, offset;
  std::vector<int> order;  // a block's sub-blocks, in the order summed
};

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
constexpr bool AVAILABLE = true;
constexpr bool SIGNED_DOT = false;  // VPDPBUSD sums byte products exactly: quants biased to bytes
constexpr bool BIASED = true;
#elif defined(__AVX2__)
constexpr bool AVAILABLE = true;
// VPMADDUBSW saturates a pair's sum at 2^15: a biased Q8_0 byte (up to 255) times 127 twice does not
// fit, so a biased format multiplies its signed quants (|q| * sign(x, q), llama.cpp's way) instead.
constexpr bool SIGNED_DOT = true;
constexpr bool BIASED = true;  // the unpacked tile's bytes, which pairs4 unbiases
#elif defined(__aarch64__) && defined(__ARM_NEON)
constexpr bool AVAILABLE = true;
// SDOT, SMMLA and SMULL multiply signed bytes, and every format's quants are int8 as they are (Q8_0's
// own, the others' 0..63): nothing is biased, Q8_0 has no offset term.
constexpr bool SIGNED_DOT = true;
constexpr bool BIASED = false;
#else
constexpr bool AVAILABLE = false;  // the ops refuse int8 calls (agent/graphs/step_graphs.py checks first)
constexpr bool SIGNED_DOT = false;
constexpr bool BIASED = false;
#endif

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) || defined(__AVX2__) || defined(__aarch64__) && defined(__ARM_NEON)

// The offset term's weight: a biased format's byte sums hold bias * sum q more (unless SIGNED_DOT).
template <class F>
constexpr bool HAS_OFFSET = F::OFFSET || (Traits<F>::BIAS != 0 && !SIGNED_DOT);

// The quants of tile `tile`'s blocks in format F, four k a column as the format's quads give them
// (plus the bias), and each sub-block's scale and offset. Unpacked a k at a time and transposed
// through a buffer before, a 16-row product of a 2048 x 2048 matrix took 0.259 ms for Q5_K, now 0.226
// (Q6_K 0.268 -> 0.231; the AVX2 target: Q5_K 0.657 -> 0.500, Q4_K 0.594 -> 0.502).
template <class F>
inline void unpack(const uint8_t *tile, int64_t k_dim, Unpacked &u) {
  using packed::LANES;
  using packed::TILE;
  using packed::vi;
  constexpr int BIAS = Traits<F>::BIAS;
  static_assert(BIAS == 0 || BIAS == 128, "a bias is Q8_0's: int8 to bytes");
  const int64_t blocks = k_dim / F::BLOCK;
  u.bytes.resize(k_dim * TILE / sizeof(vi));
  u.scale.resize(k_dim / F::SUB * TILE);
  u.offset.resize(k_dim / F::SUB * TILE);
  // Quads stored as aligned vectors through local pointers: stored as bytes (which may alias
  // anything, u's own pointers included), a 16-row product of a 2048 x 2048 Q4_K matrix took 0.20 ms,
  // now 0.17 (8 rows 0.148 -> 0.115; the AVX2 target, 16 rows of Q5_K: 0.53 -> 0.47).
  vi *const quads = u.bytes.data();
  float *const scales = u.scale.data(), *const offsets = u.offset.data();
  u.order.clear();
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t *block = tile + b * F::TILE_BYTES;
    packed::prefetch_block(block, F::TILE_BYTES);
    const int64_t first_sub = b * (F::BLOCK / F::SUB);
    for (int c = 0; c < packed::VECTORS; ++c)
      F::subs(block, c, [&](const auto &group, auto quants) {
        constexpr int N = packed::group_size<std::decay_t<decltype(group)>>();
        for (int n = 0; n < N; ++n) {
          if (b == 0 && c == 0) u.order.push_back(group.s[n]);
          const int64_t at = (first_sub + group.s[n]) * TILE + c * LANES;
          packed::vf offset = F::OFFSET ? group.offset[n] : packed::vf{};
          if (BIAS != 0 && !SIGNED_DOT) offset -= static_cast<float>(BIAS) * group.scale[n];
          std::memcpy(scales + at, &group.scale[n], sizeof(packed::vf));
          std::memcpy(offsets + at, &offset, sizeof(packed::vf));
        }
        quants.quads([&](int g, const vi (&q)[N]) {
#pragma GCC unroll 4
          for (int n = 0; n < N; ++n) {
            const int64_t k = b * F::BLOCK + group.s[n] * F::SUB + 4 * g;
            const vi bytes = BIAS != 0 && BIASED ? q[n] ^ static_cast<int32_t>(0x80808080u) : q[n];
            quads[k / 4 * packed::VECTORS + c] = bytes;
          }
        });
      });
  }
}

// Bytes to prefetch into L2 a piece at a time while a tile's rows compute: the next tile, which the
// next call unpacks (a thread's tiles are contiguous: thread_team.h for_dynamic; past a matrix's last
// tile the prefetches fall outside it, which a prefetch never faults on). Unpacking stalled
// on memory while the row products left it idle: in a 1B Q5_K decode step of 16 rows the unpacking
// was 42% of the time, the products 29%.
struct Ahead {
  const uint8_t *bytes;
  int64_t size;
  // Cache lines a piece, for n pieces (divided once a call: a division a piece cost an AVX2 prefill
  // of the default model a sixth of its time).
  int64_t lines(int64_t n) const { return (size + 64 * n - 1) / (64 * n); }
  // Piece i of `lines` lines.
  void fetch(int64_t i, int64_t lines) const {
    for (int64_t at = i * lines * 64, end = std::min(size, at + lines * 64); at < end; at += 64)
      __builtin_prefetch(bytes + at, 0, 2);
  }
};

// Activation row r's scale for the sub-block starting at k, and its sum over SUB positions.
inline float x_scale(const Rows &x, int64_t row, int64_t k) {
  return x.d[row * (x.k_dim / XBLOCK) + k / XBLOCK];
}
template <class F>
inline float x_sum(const Rows &x, int64_t row, int64_t k) {
  const float *s = x.s + row * (x.k_dim / XSUM) + k / XSUM;
  float total = s[0];
  for (int h = 1; h < F::SUB / XSUM; ++h) total += s[h];
  return total;
}

// The sub-block a row sums i-th (Unpacked::order).
template <class F>
inline int64_t summed(const Unpacked &u, int64_t i) {
  constexpr int64_t PER_BLOCK = F::BLOCK / F::SUB;
  if constexpr (PER_BLOCK == 1) return i;  // Q4_0 .. Q8_0
  return i - i % PER_BLOCK + u.order[i % PER_BLOCK];
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
constexpr int ROWS = 6;  // 2 R sums + 2 R accumulators of AVX-512's 32 registers

// Rows [row0, row0 + R) of the tile's TILE columns (col0 on) (+ residual), prefetching `ahead`.
template <class F, int R>
inline void tile_rows(const Rows &x, const Unpacked &u, const Ahead &ahead, const float *residual, float *out,
                      int64_t n_dim, int64_t row0, int64_t col0) {
  __m512 acc[R][2];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  const int64_t lines = ahead.lines(x.k_dim / F::SUB);
  for (int64_t i = 0; i < x.k_dim / F::SUB; ++i) {
    ahead.fetch(i, lines);
    const int64_t s = summed<F>(u, i);
    __m512i sums[R][2];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) sums[r][0] = sums[r][1] = _mm512_setzero_si512();
    const uint8_t *wb = u.at(s * F::SUB * packed::TILE);
    const int8_t *xb = x.q + row0 * x.k_dim + s * F::SUB;
#pragma GCC unroll 8
    for (int g = 0; g < F::SUB / 4; ++g) {
      const __m512i w0 = _mm512_loadu_si512(wb + g * 128), w1 = _mm512_loadu_si512(wb + g * 128 + 64);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        int32_t four;
        std::memcpy(&four, xb + r * x.k_dim + 4 * g, sizeof four);
        const __m512i xv = _mm512_set1_epi32(four);
        sums[r][0] = _mm512_dpbusd_epi32(sums[r][0], w0, xv);
        sums[r][1] = _mm512_dpbusd_epi32(sums[r][1], w1, xv);
      }
    }
    const float *scale = u.scale.data() + s * packed::TILE, *offset = u.offset.data() + s * packed::TILE;
    const __m512 sc[2] = {_mm512_loadu_ps(scale), _mm512_loadu_ps(scale + 16)};
    const __m512 off[2] = {_mm512_loadu_ps(offset), _mm512_loadu_ps(offset + 16)};
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m512 dx = _mm512_set1_ps(x_scale(x, row0 + r, s * F::SUB));
#pragma GCC unroll 2
      for (int h = 0; h < 2; ++h)
        acc[r][h] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums[r][h]), _mm512_mul_ps(sc[h], dx), acc[r][h]);
      if constexpr (HAS_OFFSET<F>) {
        const __m512 sx = _mm512_set1_ps(x_sum<F>(x, row0 + r, s * F::SUB));
        for (int h = 0; h < 2; ++h) acc[r][h] = _mm512_fmadd_ps(off[h], sx, acc[r][h]);
      }
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
    for (int h = 0; h < 2; ++h) packed::store(out, residual, (row0 + r) * n_dim + col0 + 16 * h, (packed::vf)acc[r][h]);
}
#elif defined(__AVX2__)
constexpr int ROWS = 3;  // a half tile at a time: 2 R pair sums + 2 R accumulators of AVX2's 16 registers

// Four byte products a column as 16-bit sums of two: w's bytes (unsigned; signed where the format is
// biased) times x's four int8.
template <class F>
inline __m256i pairs4(__m256i w, __m256i xv) {
  if constexpr (Traits<F>::BIAS != 0) {
    const __m256i q = _mm256_xor_si256(w, _mm256_set1_epi8(static_cast<char>(0x80)));  // the signed quants
    return _mm256_maddubs_epi16(_mm256_sign_epi8(q, q), _mm256_sign_epi8(xv, q));
  }
  return _mm256_maddubs_epi16(w, xv);
}

// Groups of 4 k whose 16-bit pair sums (each at most 2 x 127 x the largest quant) add up without
// overflow before they are widened to 32 bits: Q4 formats 8, Q5 4, Q6_K 2, Q8_0 1 (a VPMADDWD and
// an add a group saved: 16 rows of a 2048 x 2048 Q4_K matrix 0.62 -> 0.56 ms).
template <class F>
constexpr int RUN = std::max(1, std::min(F::SUB / 4, 32767 / (2 * 127 * Traits<F>::MAX_QUANT)));

template <class F, int R>
inline void tile_rows(const Rows &x, const Unpacked &u, const Ahead &ahead, const float *residual, float *out,
                      int64_t n_dim, int64_t row0, int64_t col0) {
  const __m256i ones = _mm256_set1_epi16(1);
  const int64_t lines = ahead.lines(2 * (x.k_dim / F::SUB));
  for (int half = 0; half < 2; ++half) {
    __m256 acc[R][2];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    for (int64_t i = 0; i < x.k_dim / F::SUB; ++i) {
      ahead.fetch(half * (x.k_dim / F::SUB) + i, lines);
      const int64_t s = summed<F>(u, i);
      const uint8_t *wb = u.at(s * F::SUB * packed::TILE + 64 * half);
      const int8_t *xb = x.q + row0 * x.k_dim + s * F::SUB;
      const float *scale = u.scale.data() + s * packed::TILE + 16 * half;
      const float *offset = u.offset.data() + s * packed::TILE + 16 * half;
      auto load = [&](int g, int h) { return _mm256_loadu_si256(reinterpret_cast<const __m256i *>(wb + g * 128 + 32 * h)); };
      // Runs of groups summed in 16 bits, widened to the sub-block's 32-bit sums, which are scaled
      // once as straight from the blocks (scaled a run at a time, a row's Q5 and Q6_K sums rounded
      // otherwise above 4 rows than at 1-4: batch invariance).
      __m256i sums[R][2];
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) sums[r][0] = sums[r][1] = _mm256_setzero_si256();
#pragma GCC unroll 8
      for (int g0 = 0; g0 < F::SUB / 4; g0 += RUN<F>) {
        __m256i pairs[R][2];
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) pairs[r][0] = pairs[r][1] = _mm256_setzero_si256();
#pragma GCC unroll 8
        for (int g = g0; g < g0 + RUN<F>; ++g) {
          const __m256i w0 = load(g, 0), w1 = load(g, 1);
#pragma GCC unroll 8
          for (int r = 0; r < R; ++r) {
            int32_t four;
            std::memcpy(&four, xb + r * x.k_dim + 4 * g, sizeof four);
            const __m256i xv = _mm256_set1_epi32(four);
            pairs[r][0] = _mm256_add_epi16(pairs[r][0], pairs4<F>(w0, xv));
            pairs[r][1] = _mm256_add_epi16(pairs[r][1], pairs4<F>(w1, xv));
          }
        }
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r)
          for (int h = 0; h < 2; ++h) sums[r][h] = _mm256_add_epi32(sums[r][h], _mm256_madd_epi16(pairs[r][h], ones));
      }
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const __m256 dx = _mm256_set1_ps(x_scale(x, row0 + r, s * F::SUB));
        for (int h = 0; h < 2; ++h) {
          const __m256 sc = _mm256_mul_ps(_mm256_loadu_ps(scale + 8 * h), dx);
          acc[r][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums[r][h]), sc, acc[r][h]);
        }
        if constexpr (HAS_OFFSET<F>) {
          const __m256 sx = _mm256_set1_ps(x_sum<F>(x, row0 + r, s * F::SUB));
          for (int h = 0; h < 2; ++h) acc[r][h] = _mm256_fmadd_ps(_mm256_loadu_ps(offset + 8 * h), sx, acc[r][h]);
        }
      }
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r)
      for (int h = 0; h < 2; ++h)
        packed::store(out, residual, (row0 + r) * n_dim + col0 + 16 * half + 8 * h, (packed::vf)acc[r][h]);
  }
}
#else
// AArch64 (packed::LANES 4: a vi is one NEON register). Not measured on Arm hardware.
constexpr int ROWS = 6;  // a vector of 4 columns at a time: R sums + R accumulators of NEON's 32 registers

// sums + the byte products of four k a column: lane t of q holds column t's four quants (packed::quad's
// layout, int8), times x's four int8 `four`. SDOT sums each lane's four products in one instruction;
// plain NEON multiplies into 16-bit products (SMULL), adds them in pairs (ADDP: at most 2 x 128 x 127,
// no overflow) and the pairs into the 32-bit sums (SADALP).
inline packed::vi dot4_neon(packed::vi sums, packed::vi q, int32_t four) {
  const int8x16_t w = vreinterpretq_s8_s32((int32x4_t)q), xv = vreinterpretq_s8_s32(vdupq_n_s32(four));
#ifdef __ARM_FEATURE_DOTPROD
  return (packed::vi)vdotq_s32((int32x4_t)sums, w, xv);
#else
  const int16x8_t low = vmull_s8(vget_low_s8(w), vget_low_s8(xv)), high = vmull_high_s8(w, xv);
  return (packed::vi)vpadalq_s16((int32x4_t)sums, vpaddq_s16(low, high));
#endif
}

// A sub-block's integer sums scaled into a row's accumulator, as direct_rows scales them (the same
// expression: a row's float sums alike at every row count).
template <class F>
inline void scale_into(packed::vf &acc, packed::vi sums, const Rows &x, const Unpacked &u, int64_t row,
                       int64_t s, int c) {
  packed::vf scale, offset;
  std::memcpy(&scale, u.scale.data() + s * packed::TILE + c * packed::LANES, sizeof scale);
  acc += packed::to_float(sums) * (scale * x_scale(x, row, s * F::SUB));
  if constexpr (HAS_OFFSET<F>) {
    std::memcpy(&offset, u.offset.data() + s * packed::TILE + c * packed::LANES, sizeof offset);
    acc += offset * x_sum<F>(x, row, s * F::SUB);
  }
}

#ifdef __ARM_FEATURE_MATMUL_INT8
// Rows in pairs by SMMLA: a 2 x 8 block of two rows' int8 (eight k each) times 8 x 2 of two columns'
// quants into the 2 x 2 sums, 32 byte products an instruction. The unpacked tile's four k a column of
// groups g and g + 1 interleaved (ZIP1, ZIP2) are two columns' eight k; an odd block's last row is
// paired with itself. Straight from the blocks (1 to 4 rows) stays SDOT: the formats give their quants
// a group of four k at a time (formats/format.h quads), and a decode row has no pair.
template <class F, int R>
inline void tile_rows(const Rows &x, const Unpacked &u, const Ahead &ahead, const float *residual, float *out,
                      int64_t n_dim, int64_t row0, int64_t col0) {
  using packed::LANES;
  using packed::TILE;
  constexpr int PAIRS = (R + 1) / 2;
  const int64_t subs = x.k_dim / F::SUB, lines = ahead.lines(packed::VECTORS * subs);
  for (int c = 0; c < packed::VECTORS; ++c) {
    packed::vf acc[R];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) acc[r] = packed::vf{};
    for (int64_t i = 0; i < subs; ++i) {
      ahead.fetch(c * subs + i, lines);
      const int64_t s = summed<F>(u, i);
      const uint8_t *wb = u.at(s * F::SUB * TILE + 4 * LANES * c);
      const int8_t *xb = x.q + row0 * x.k_dim + s * F::SUB;
      int32x4_t sums[PAIRS][2];  // per pair: [r t, r t+1, r+1 t, r+1 t+1] of columns (0, 1), (2, 3)
#pragma GCC unroll 8
      for (int p = 0; p < PAIRS; ++p) sums[p][0] = sums[p][1] = vdupq_n_s32(0);
#pragma GCC unroll 8
      for (int g = 0; g < F::SUB / 4; g += 2) {
        const int32x4_t w0 = vld1q_s32(reinterpret_cast<const int32_t *>(wb + g * 4 * TILE));
        const int32x4_t w1 = vld1q_s32(reinterpret_cast<const int32_t *>(wb + (g + 1) * 4 * TILE));
        const int8x16_t columns01 = vreinterpretq_s8_s32(vzip1q_s32(w0, w1));
        const int8x16_t columns23 = vreinterpretq_s8_s32(vzip2q_s32(w0, w1));
#pragma GCC unroll 8
        for (int p = 0; p < PAIRS; ++p) {
          const int second = 2 * p + 1 < R ? 2 * p + 1 : 2 * p;
          const int8x16_t rows = vcombine_s8(vld1_s8(xb + 2 * p * x.k_dim + 4 * g), vld1_s8(xb + second * x.k_dim + 4 * g));
          sums[p][0] = vmmlaq_s32(sums[p][0], rows, columns01);
          sums[p][1] = vmmlaq_s32(sums[p][1], rows, columns23);
        }
      }
#pragma GCC unroll 8
      for (int p = 0; p < PAIRS; ++p) {
        const int64x2_t a = vreinterpretq_s64_s32(sums[p][0]), b = vreinterpretq_s64_s32(sums[p][1]);
        scale_into<F>(acc[2 * p], (packed::vi)vreinterpretq_s32_s64(vzip1q_s64(a, b)), x, u, row0 + 2 * p, s, c);
        if (2 * p + 1 < R)
          scale_into<F>(acc[2 * p + 1], (packed::vi)vreinterpretq_s32_s64(vzip2q_s64(a, b)), x, u, row0 + 2 * p + 1, s, c);
      }
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) packed::store(out, residual, (row0 + r) * n_dim + col0 + c * LANES, acc[r]);
  }
}
#else
// A vector of columns at a time, the rows' sums by dot4_neon (SDOT, or plain NEON).
template <class F, int R>
inline void tile_rows(const Rows &x, const Unpacked &u, const Ahead &ahead, const float *residual, float *out,
                      int64_t n_dim, int64_t row0, int64_t col0) {
  using packed::LANES;
  using packed::TILE;
  const int64_t subs = x.k_dim / F::SUB, lines = ahead.lines(packed::VECTORS * subs);
  for (int c = 0; c < packed::VECTORS; ++c) {
    packed::vf acc[R];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) acc[r] = packed::vf{};
    for (int64_t i = 0; i < subs; ++i) {
      ahead.fetch(c * subs + i, lines);
      const int64_t s = summed<F>(u, i);
      const uint8_t *wb = u.at(s * F::SUB * TILE + 4 * LANES * c);
      const int8_t *xb = x.q + row0 * x.k_dim + s * F::SUB;
      packed::vi sums[R];
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) sums[r] = packed::vi{};
#pragma GCC unroll 8
      for (int g = 0; g < F::SUB / 4; ++g) {
        packed::vi q;
        std::memcpy(&q, wb + g * 4 * TILE, sizeof q);
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {
          int32_t four;
          std::memcpy(&four, xb + r * x.k_dim + 4 * g, sizeof four);
          sums[r] = dot4_neon(sums[r], q, four);
        }
      }
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) scale_into<F>(acc[r], sums[r], x, u, row0 + r, s, c);
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) packed::store(out, residual, (row0 + r) * n_dim + col0 + c * LANES, acc[r]);
  }
}
#endif
#endif

// Calls of up to DIRECT_ROWS rows read the blocks directly, four k of a column at a time
// (formats/format.h quads): an unpacked copy's writing and reading cost more than a few rows'
// products. A 2048 x 2048 matrix, 1 row (2-core EPYC), float32 / unpacked / direct: Q4_K 0.082 /
// 0.105 / 0.057 ms, Q6_K 0.119 / - / 0.076; 4 rows, Q4_K 0.158 / - / 0.088. The AVX2 target, 1 row:
// Q4_K 0.124 -> 0.072 ms. AVX-512 takes 5 rows in one block where a group holds 1 or 2 sub-blocks
// (N + 2 registers a row of its 32): a step that verifies 4 proposals, unpacked -> direct (2-core
// Xeon), the default model 9.3 -> 8.3 ms, a 1B Q4_K_M 58 -> 52 ms; 6 rows direct ran slower than
// unpacked (74 against 61 ms: registers spilled), and so do Q6_K's 4-sub-block groups above 4 rows.
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
// Sub-blocks a format's groups unpack together (formats/format.h Group<N>).
constexpr int group_subs(int32_t id) {
  switch (id) {
    case formats::Q2_K::ID: case formats::Q3_K::ID: case formats::Q6_K::ID: return 4;
    case formats::Q4_K::ID: case formats::Q5_K::ID: return 2;
    default: return 1;
  }
}
template <class F>
constexpr int DIRECT_BLOCK = group_subs(F::ID) <= 2 ? 5 : 4;
#else
// AVX2's 16 registers: a group's sums (up to 4 sub-blocks) a row; NEON's 32 registers of 4 lanes: a
// row's 8 accumulators and a group's sums
template <class F>
constexpr int DIRECT_BLOCK = 2;
#endif
template <class F>
constexpr int64_t DIRECT_ROWS = std::max(4, DIRECT_BLOCK<F>);

// sums + the byte products of four k a column: quants q (packed::quad's layout, the format's low 8
// bits) times x's four int8 `four`.
template <class F>
inline packed::vi dot4(packed::vi sums, packed::vi q, int32_t four) {
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
  if constexpr (Traits<F>::BIAS != 0) q ^= static_cast<int32_t>(0x80808080u);  // Q8_0's int8 + 128
  return (packed::vi)_mm512_dpbusd_epi32((__m512i)sums, (__m512i)q, _mm512_set1_epi32(four));
#elif defined(__AVX2__)
  if constexpr (Traits<F>::BIAS != 0) q ^= static_cast<int32_t>(0x80808080u);  // pairs4 takes biased bytes
  const __m256i pairs = pairs4<F>((__m256i)q, _mm256_set1_epi32(four));
  return sums + (packed::vi)_mm256_madd_epi16(pairs, _mm256_set1_epi16(1));
#else
  return dot4_neon(sums, q, four);  // Q8_0's int8 quants as they are
#endif
}

// Rows [row0, row0 + R) of the tile (its blocks at `tile`; columns col0 on) (+ residual), straight
// from the blocks: per sub-block, the integer sums of each vector of columns, then scaled. Each block
// whole (every vector of columns) before the next, so the tile streams from memory once, its
// prefetches running all along (a pass a vector of columns left memory idle through the second: 1B
// Q8_0 decode steps of 1 row took 37 ms against float32's 30).
template <class F, int R>
inline void direct_rows(const Rows &x, const uint8_t *tile, const float *residual, float *out, int64_t n_dim,
                        int64_t row0, int64_t col0) {
  using packed::vf;
  using packed::vi;
  constexpr int VECTORS = packed::VECTORS;
  const int64_t blocks = x.k_dim / F::BLOCK;
  vf acc[VECTORS][R];
#pragma GCC unroll 4
  for (int c = 0; c < VECTORS; ++c)
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) acc[c][r] = vf{};
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t *block = tile + b * F::TILE_BYTES;
    packed::prefetch_block(block, F::TILE_BYTES);
#pragma GCC unroll 4
    for (int c = 0; c < VECTORS; ++c)
      F::subs(block, c, [&](const auto &group, auto quants) {
        constexpr int N = packed::group_size<std::decay_t<decltype(group)>>();
        vi sums[N][R];
#pragma GCC unroll 4
        for (int n = 0; n < N; ++n)
#pragma GCC unroll 4
          for (int r = 0; r < R; ++r) sums[n][r] = vi{};
        quants.quads([&](int g, const vi (&q)[N]) {
#pragma GCC unroll 4
          for (int n = 0; n < N; ++n)
#pragma GCC unroll 4
            for (int r = 0; r < R; ++r) {
              int32_t four;
              std::memcpy(&four, x.q + (row0 + r) * x.k_dim + b * F::BLOCK + group.s[n] * F::SUB + 4 * g, sizeof four);
              sums[n][r] = dot4<F>(sums[n][r], q[n], four);
            }
        });
#pragma GCC unroll 4
        for (int n = 0; n < N; ++n) {
          const int64_t k = b * F::BLOCK + group.s[n] * F::SUB;
          vf offset = F::OFFSET ? group.offset[n] : vf{};
          if (Traits<F>::BIAS != 0 && !SIGNED_DOT) offset -= static_cast<float>(Traits<F>::BIAS) * group.scale[n];
#pragma GCC unroll 4
          for (int r = 0; r < R; ++r) {
            acc[c][r] += packed::to_float(sums[n][r]) * (group.scale[n] * x_scale(x, row0 + r, k));
            if constexpr (HAS_OFFSET<F>) acc[c][r] += offset * x_sum<F>(x, row0 + r, k);
          }
        }
      });
  }
#pragma GCC unroll 4
  for (int c = 0; c < VECTORS; ++c)
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      packed::store(out, residual, (row0 + r) * n_dim + col0 + c * packed::LANES, acc[c][r]);
    }
}

// Tile j of x @ W (+ residual) for all m_dim rows of x (quantized): false where W's format does not
// take int8 activations (F32, F16, BF16), which then multiplies as float32.
inline bool tile(const product::Matrix &w, const Rows &x, const float *residual, float *out, int64_t m_dim,
                 int64_t n_dim, int64_t j) {
  bool done = false;
  product::visit(w.format, [&](auto f) {
    using F = decltype(f);
    if constexpr (Traits<F>::USABLE) {
      const int64_t blocks = w.k_dim / F::BLOCK;
      const uint8_t *tile = static_cast<const uint8_t *>(w.w) + j * blocks * F::TILE_BYTES;
      if (m_dim <= DIRECT_ROWS<F>) {
        packed::equal_blocks(m_dim, DIRECT_BLOCK<F>, [&](int64_t row, int64_t n) {
          packed::with_rows<DIRECT_BLOCK<F>>(n, [&](auto rows) {
            direct_rows<F, decltype(rows)::value>(x, tile, residual, out, n_dim, row, j * packed::TILE);
          });
        });
        done = true;
        return;
      }
      thread_local Unpacked unpacked;
      unpack<F>(tile, w.k_dim, unpacked);
      const int64_t tile_bytes = blocks * F::TILE_BYTES, row_blocks = (m_dim + ROWS - 1) / ROWS;
      int64_t row_block = 0;
      packed::equal_blocks(m_dim, ROWS, [&](int64_t row, int64_t n) {
        const int64_t from = tile_bytes * row_block / row_blocks, to = tile_bytes * ++row_block / row_blocks;
        const Ahead ahead{tile + tile_bytes + from, to - from};
        packed::with_rows<ROWS>(n, [&](auto rows) {
          tile_rows<F, decltype(rows)::value>(x, unpacked, ahead, residual, out, n_dim, row, j * packed::TILE);
        });
      });
      done = true;
    }
  });
  return done;
}
#else
inline bool tile(const product::Matrix &, const Rows &, const float *, float *, int64_t, int64_t, int64_t) {
  return false;
}
#endif

}  // namespace int8
