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

  template <class Sub>
  static void subs(const uint8_t *block, int c, Sub sub) {
    const vf d = packed::load_half(field(block, 108, 2, c));
    for (int s = 0; s < 16; ++s) {
      const vi low = (packed::widen(field(block, 96, 1, c, s % 8)) >> (4 * (s / 8))) & 15;
      const vi top = (packed::widen(field(block, 96, 1, c, 8 + s % 4)) >> (2 * (s / 4))) & 3;
      const vf scale = d * to_float((low | (top << 4)) - 32);
      const int row = 32 * (s / 8) + 16 * (s % 2), shift = 2 * (s % 8 / 2), bit = s / 2;
      sub(s, scale, -4.f * scale, [&](auto each) {
#pragma GCC unroll 8
        for (int i = 0; i < 16; ++i) {
          const vi q = (packed::widen(field(block, 32, 1, c, row + i)) >> shift) & 3;
          const vi h = (packed::widen(field(block, 0, 1, c, row % 32 + i)) >> bit) & 1;
          each(i, to_float(q | (h << 2)));
        }
      });
    }
  }
};

}  // namespace formats
