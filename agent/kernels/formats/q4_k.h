// GGUF Q4_K: 256 weights a block: d, dmin (half), scales[12] (8 six-bit scales and 8 six-bit mins,
// gguf.quants.Q4_K.get_scale_min), qs[128] (sub-block 2 j at the low nibbles of bytes 32 j .. 32 j +
// 31, 2 j + 1 at their high nibbles); weight = d * scale * q - dmin * min.
#pragma once

#include "format.h"

namespace formats {

// Sub-block s's six-bit scale and min of a K-quant's 12 scale bytes at `offset` (Q4_K, Q5_K).
inline void k_scale_min(const uint8_t *block, int offset, int c, int s, vi &scale, vi &min) {
  auto byte = [&](int u) { return packed::widen(field(block, offset, 1, c, u)); };
  if (s < 4) {
    scale = byte(s) & 63;
    min = byte(s + 4) & 63;
  } else {
    const vi both = byte(s + 4);
    scale = (both & 15) | ((byte(s - 4) >> 2) & 0x30);
    min = (both >> 4) | ((byte(s) >> 2) & 0x30);
  }
}

struct Q4_K {
  static constexpr int32_t ID = 12;
  static constexpr int BLOCK = 256, SUB = 32;
  static constexpr bool OFFSET = true;
  static constexpr int64_t TILE_BYTES = 144 * TILE;
  static constexpr int64_t ROW_BY_ROW = 1;

  // Groups of sub-blocks 2 j and 2 j + 1: the low and high nibbles of bytes 32 j .. 32 j + 31.
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
          const vi q = packed::widen(field(block, 16, 1, c, 32 * j + i));
          each(i, {q & 15, q >> 4});
        }
      }, [&](auto each) {
#pragma GCC unroll 8
        for (int g = 0; g < 8; ++g) {
          const vi q = packed::quad(field(block, 16, 1, c, 32 * j + 4 * g));
          each(g, {q & NIBBLES, (q >> 4) & NIBBLES});
        }
      }));
    }
  }
};

}  // namespace formats
