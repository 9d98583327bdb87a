// GGUF Q3_K: 256 weights a block: hmask[32] (weight 32 j + l's high bit at bit j of byte l), qs[64]
// (low 2 bits as Q2_K's), scales[12] (16 six-bit scales: low 4 bits in bytes 0-7, low nibbles then
// high; top 2 bits in bytes 8-11, sub-block s at bits 2 (s / 4) of byte 8 + s % 4), d (half);
// weight = d * (scale - 32) * (q - 4 + 4 * high bit).
#pragma once

#include "format.h"

namespace formats {

struct Q3_K {
  static constexpr int32_t ID = 11;
  static constexpr int BLOCK = 256, SUB = 16;
  static constexpr bool OFFSET = true;  // the -4 of every quant: scale * (q + 4 h) - 4 scale
  static constexpr int64_t TILE_BYTES = 110 * TILE;
  static constexpr int64_t ROW_BY_ROW = 1;

  // Groups as Q2_K's (four sub-blocks a byte of low bits), their high bits (bits 4 n + j of
  // hmask byte 16 half + i) from one byte too.
  template <class Use>
  static void subs(const uint8_t *block, int c, Use use) {
    const vf d = packed::load_half(field(block, 108, 2, c));
    for (int g = 0; g < 4; ++g) {
      const int n = g / 2, half = g % 2;
      Group<4> group;
      for (int j = 0; j < 4; ++j) {
        const int s = 8 * n + 2 * j + half;
        const vi low = (packed::widen(field(block, 96, 1, c, s % 8)) >> (4 * (s / 8))) & 15;
        const vi top = (packed::widen(field(block, 96, 1, c, 8 + s % 4)) >> (2 * (s / 4))) & 3;
        group.s[j] = s, group.scale[j] = d * to_float((low | (top << 4)) - 32);
        group.offset[j] = -4.f * group.scale[j];
      }
      use(group, quants([&](auto each) {
#pragma GCC unroll 4
        for (int i = 0; i < 16; ++i) {
          const vi q = packed::widen(field(block, 32, 1, c, 32 * n + 16 * half + i));
          const vi h = packed::widen(field(block, 0, 1, c, 16 * half + i)) >> (4 * n) << 2;
          each(i, {(q & 3) | (h & 4), ((q >> 2) & 3) | ((h >> 1) & 4),
                   ((q >> 4) & 3) | ((h >> 2) & 4), (q >> 6) | ((h >> 3) & 4)});
        }
      }, [&](auto each) {
        constexpr int32_t TWO_BITS = 0x03030303, HIGH = 0x04040404;
#pragma GCC unroll 4
        for (int g = 0; g < 4; ++g) {
          const vi q = packed::quad(field(block, 32, 1, c, 32 * n + 16 * half + 4 * g));
          const vi h = packed::quad(field(block, 0, 1, c, 16 * half + 4 * g)) >> (4 * n);
          each(g, {(q & TWO_BITS) | ((h << 2) & HIGH), ((q >> 2) & TWO_BITS) | ((h << 1) & HIGH),
                   ((q >> 4) & TWO_BITS) | (h & HIGH), ((q >> 6) & TWO_BITS) | ((h >> 1) & HIGH)});
        }
      }));
    }
  }
};

}  // namespace formats
