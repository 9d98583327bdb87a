// GGUF Q2_K: 256 weights a block: scales[16] (sub-block s of 16 weights: scale s & 15, min s >> 4),
// qs[64] (2 bits a weight: weight 128 n + 32 j + l at bits 2 j of byte 32 n + l), d, dmin (half);
// weight = d * scale * q - dmin * min.
#pragma once

#include "format.h"

namespace formats {

struct Q2_K {
  static constexpr int32_t ID = 10;
  static constexpr int BLOCK = 256, SUB = 16;
  static constexpr bool OFFSET = true;
  static constexpr int64_t TILE_BYTES = 84 * TILE;
  static constexpr int64_t ROW_BY_ROW = 1;

  // Groups of the four sub-blocks whose 2-bit quants share a byte: weights 128 n + 32 j + 16 half + i
  // (j = 0..3, sub-block 8 n + 2 j + half) at bits 2 j of byte 32 n + 16 half + i.
  template <class Use>
  static void subs(const uint8_t *block, int c, Use use) {
    const vf d = packed::load_half(field(block, 80, 2, c)), dmin = packed::load_half(field(block, 82, 2, c));
    for (int g = 0; g < 4; ++g) {
      const int n = g / 2, half = g % 2;
      Group<4> group;
      for (int j = 0; j < 4; ++j) {
        const int s = 8 * n + 2 * j + half;
        const vi scales = packed::widen(field(block, 0, 1, c, s));
        group.s[j] = s, group.scale[j] = d * to_float(scales & 15), group.offset[j] = -(dmin * to_float(scales >> 4));
      }
      use(group, quants([&](auto each) {
#pragma GCC unroll 4
        for (int i = 0; i < 16; ++i) {
          const vi q = packed::widen(field(block, 16, 1, c, 32 * n + 16 * half + i));
          each(i, {q & 3, (q >> 2) & 3, (q >> 4) & 3, q >> 6});
        }
      }, [&](auto each) {
        constexpr int32_t TWO_BITS = 0x03030303;
#pragma GCC unroll 4
        for (int g = 0; g < 4; ++g) {
          const vi q = packed::quad(field(block, 16, 1, c, 32 * n + 16 * half + 4 * g));
          each(g, {q & TWO_BITS, (q >> 2) & TWO_BITS, (q >> 4) & TWO_BITS, (q >> 6) & TWO_BITS});
        }
      }));
    }
  }
};

}  // namespace formats
