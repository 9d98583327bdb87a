// GGUF Q5_0: 32 weights a block: d (half), qh (32 bits: bit j is weight j's fifth bit), 16 bytes of
// nibbles (byte j: weight j low, j + 16 high); weight = d * (q - 16).
#pragma once

#include "format.h"

namespace formats {

struct Q5_0 {
  static constexpr int32_t ID = 6;
  static constexpr int BLOCK = 32, SUB = 32;
  static constexpr bool OFFSET = true;  // d * q - 16 d, exactly d * (q - 16)
  static constexpr int64_t TILE_BYTES = 22 * TILE;
  static constexpr int64_t ROW_BY_ROW = 1;

  template <class Use>
  static void subs(const uint8_t *block, int c, Use use) {
    const vf d = packed::load_half(field(block, 0, 2, c));
    const vi high = packed::load_u32(field(block, 2, 4, c));
    use(Group<1>{{0}, {d}, {-16.f * d}}, quants([&](auto each) {
#pragma GCC unroll 8
      for (int i = 0; i < 16; ++i) {
        const vi q = packed::widen(field(block, 6, 1, c, i));
        each(i, {(q & 15) | ((high >> i << 4) & 16)});
        each(i + 16, {(q >> 4) | ((high >> (i + 16) << 4) & 16)});
      }
    }, [&](auto each) {
#pragma GCC unroll 4
      for (int g = 0; g < 4; ++g) {
        const vi q = packed::quad(field(block, 6, 1, c, 4 * g));
        each(g, {(q & NIBBLES) | spread_bits(high >> (4 * g)) << 4});
        each(g + 4, {((q >> 4) & NIBBLES) | spread_bits(high >> (16 + 4 * g)) << 4});
      }
    }));
  }
};

}  // namespace formats
