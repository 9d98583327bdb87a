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

  template <class Sub>
  static void subs(const uint8_t *block, int c, Sub sub) {
    const vf d = packed::load_half(field(block, 0, 2, c)), dmin = packed::load_half(field(block, 2, 2, c));
    for (int s = 0; s < 8; ++s) {
      vi scale, min;
      k_scale_min(block, 4, c, s, scale, min);
      const int shift = 4 * (s % 2);
      sub(s, d * to_float(scale), -(dmin * to_float(min)), [&](auto each) {
#pragma GCC unroll 8
        for (int i = 0; i < 32; ++i) {
          const vi q = (packed::widen(field(block, 48, 1, c, 32 * (s / 2) + i)) >> shift) & 15;
          const vi h = (packed::widen(field(block, 16, 1, c, i)) >> s) & 1;
          each(i, to_float(q | (h << 4)));
        }
      });
    }
  }
};

}  // namespace formats
