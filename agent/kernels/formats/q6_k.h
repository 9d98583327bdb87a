// GGUF Q6_K: 256 weights a block: ql[128] (weight 128 h + r's low 4 bits in nibble r / 64 of byte
// 64 h + r % 64), qh[64] (its top 2 bits at bits 2 (r / 32) of byte 32 h + r % 32), scales[16]
// (int8, a sub-block of 16 each), d (half); weight = d * scale * (q - 32).
#pragma once

#include "format.h"

namespace formats {

struct Q6_K {
  static constexpr int32_t ID = 14;
  static constexpr int BLOCK = 256, SUB = 16;
  static constexpr bool OFFSET = true;  // scale * q - 32 scale, exactly scale * (q - 32)
  static constexpr int64_t TILE_BYTES = 210 * TILE;
  static constexpr int64_t ROW_BY_ROW = 1;

  template <class Sub>
  static void subs(const uint8_t *block, int c, Sub sub) {
    const vf d = packed::load_half(field(block, 208, 2, c));
    for (int s = 0; s < 16; ++s) {
      const vf scale = d * to_float(packed::widen_signed(field(block, 192, 1, c, s)));
      const int h = s / 8, r = 16 * (s % 8);  // k = 128 h + r + i
      sub(s, scale, -32.f * scale, [&](auto each) {
#pragma GCC unroll 8
        for (int i = 0; i < 16; ++i) {
          const vi low = (packed::widen(field(block, 0, 1, c, 64 * h + (r + i) % 64)) >> (4 * (r / 64))) & 15;
          const vi top = (packed::widen(field(block, 128, 1, c, 32 * h + (r + i) % 32)) >> (2 * (r / 32))) & 3;
          each(i, to_float(low | (top << 4)));
        }
      });
    }
  }
};

}  // namespace formats
