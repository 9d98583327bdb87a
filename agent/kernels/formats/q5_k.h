// GGUF Q5_K: 256 weights a block: d, dmin (half), scales[12] (as Q4_K's), qh[32] (sub-block s's
// fifth bits at bit s of bytes 0-31), qs[128] (as Q4_K's); weight = d * scale * q - dmin * min.
#pragma once

#include "format.h"
#include "q4_k.h"

namespace formats {

struct Q5_K {
  static constexpr int32_t ID = 13;
  static constexpr int BLOCK = 256, SUB = 32;
  static constexpr bool OFFSET = true;
  static constexpr int64_t TILE_BYTES = 176 * TILE;
  static constexpr int64_t ROW_BY_ROW = 1;

  // Groups as Q4_K's; sub-block s's fifth bits at bit s of qh byte i.
  template <class Use>
  static void subs(const uint8_t *block, int c, Use use) {
    const vf d = packed::load_half(field(block, 0, 2, c)), dmin = packed::load_half(field(block, 2, 2, c));
    for (int j = 0; j < 4; ++j) {
      Group<2> group;
      for (int h = 0; h < 2; ++h) {
        vi scale, min;
        k_scale_min(block, 4, c, 2 * j + h, scale, min);
        group.s[h] = 2 * j + h, group.scale[h] = d * to_float(scale), group.offset[h] = -(dmin * to_float(min));
      }
      use(group, quants([&](auto each) {
#pragma GCC unroll 8
        for (int i = 0; i < 32; ++i) {
          const vi q = packed::widen(field(block, 48, 1, c, 32 * j + i));
          const vi high = packed::widen(field(block, 16, 1, c, i)) >> (2 * j) << 4;
          each(i, {(q & 15) | (high & 16), (q >> 4) | ((high >> 1) & 16)});
        }
      }, [&](auto each) {
#pragma GCC unroll 8
        for (int g = 0; g < 8; ++g) {
          const vi q = packed::quad(field(block, 48, 1, c, 32 * j + 4 * g));
          const vi high = packed::quad(field(block, 16, 1, c, 4 * g)) >> (2 * j);
          each(g, {(q & NIBBLES) | ((high << 4) & 0x10101010), ((q >> 4) & NIBBLES) | ((high << 3) & 0x10101010)});
        }
      }));
    }
  }
};

}  // namespace formats
