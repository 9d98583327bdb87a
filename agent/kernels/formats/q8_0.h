// GGUF Q8_0: 32 weights a block: d (half), 32 int8 quants; weight = d * q.
#pragma once

#include "format.h"

namespace formats {

struct Q8_0 {
  static constexpr int32_t ID = 8;
  static constexpr int BLOCK = 32, SUB = 32;
  static constexpr bool OFFSET = false;
  static constexpr int64_t TILE_BYTES = 34 * TILE;
  static constexpr int64_t ROW_BY_ROW = 2;  // 2 rows direct: 1.1 -> 1.35 ms (the default model's LM head)

  template <class Use>
  static void subs(const uint8_t *block, int c, Use use) {
    use(Group<1>{{0}, {packed::load_half(field(block, 0, 2, c))}, {vf{}}}, quants([&](auto each) {
#pragma GCC unroll 8
      for (int i = 0; i < 32; ++i) each(i, {packed::widen_signed(field(block, 2, 1, c, i))});
    }, [&](auto each) {
#pragma GCC unroll 8
      for (int g = 0; g < 8; ++g) each(g, {packed::quad(field(block, 2, 1, c, 4 * g))});
    }));
  }
};

}  // namespace formats
