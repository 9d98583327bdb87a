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

  // Groups of the four sub-blocks whose top bits share a qh byte: weights 128 h + 32 j + 16 half + i
  // (j = 0..3, sub-block 8 h + 2 j + half); their low bits are two ql bytes' nibbles.
  template <class Use>
  static void subs(const uint8_t *block, int c, Use use) {
    const vf d = packed::load_half(field(block, 208, 2, c));
    for (int g = 0; g < 4; ++g) {
      const int h = g / 2, half = g % 2;
      Group<4> group;
      for (int j = 0; j < 4; ++j) {
        const int s = 8 * h + 2 * j + half;
        group.s[j] = s, group.scale[j] = d * to_float(packed::widen_signed(field(block, 192, 1, c, s)));
        group.offset[j] = -32.f * group.scale[j];
      }
      use(group, quants([&](auto each) {
#pragma GCC unroll 4
        for (int i = 0; i < 16; ++i) {
          const int l = 16 * half + i;
          const vi a = packed::widen(field(block, 0, 1, c, 64 * h + l));
          const vi b = packed::widen(field(block, 0, 1, c, 64 * h + 32 + l));
          const vi top = packed::widen(field(block, 128, 1, c, 32 * h + l)) << 4;
          each(i, {(a & 15) | (top & 0x30), (b & 15) | ((top >> 2) & 0x30),
                   (a >> 4) | ((top >> 4) & 0x30), (b >> 4) | ((top >> 6) & 0x30)});
        }
      }, [&](auto each) {
        constexpr int32_t TOP = 0x30303030;
#pragma GCC unroll 4
        for (int g4 = 0; g4 < 4; ++g4) {
          const int l = 16 * half + 4 * g4;
          const vi a = packed::quad(field(block, 0, 1, c, 64 * h + l));
          const vi b = packed::quad(field(block, 0, 1, c, 64 * h + 32 + l));
          const vi top = packed::quad(field(block, 128, 1, c, 32 * h + l));
          each(g4, {(a & NIBBLES) | ((top << 4) & TOP), (b & NIBBLES) | ((top << 2) & TOP),
                    ((a >> 4) & NIBBLES) | (top & TOP), ((b >> 4) & NIBBLES) | ((top >> 2) & TOP)});
        }
      }));
    }
  }
};

}  // namespace formats
