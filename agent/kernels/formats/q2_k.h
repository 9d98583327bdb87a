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

  template <class Sub>
  static void subs(const uint8_t *block, int c, Sub sub) {
    const vf d = packed::load_half(field(block, 80, 2, c)), dmin = packed::load_half(field(block, 82, 2, c));
    for (int s = 0; s < 16; ++s) {
      const vi scales = packed::widen(field(block, 0, 1, c, s));
      const int row = 32 * (s / 8) + 16 * (s % 2), shift = 2 * (s % 8 / 2);
      sub(s, d * to_float(scales & 15), -(dmin * to_float(scales >> 4)), [&](auto each) {
#pragma GCC unroll 8
        for (int i = 0; i < 16; ++i) each(i, to_float((packed::widen(field(block, 16, 1, c, row + i)) >> shift) & 3));
      });
    }
  }
};

}  // namespace formats
