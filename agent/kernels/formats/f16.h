// GGUF F16 and BF16 weights (16 bits a weight, no scales), packed as the quantized formats are with
// blocks of 32 weights.
#pragma once

#include "format.h"

namespace formats {

template <int32_t Id, vf (*Load)(const uint8_t *)>
struct Float16Bits {
  static constexpr int32_t ID = Id;
  static constexpr int BLOCK = 32, SUB = 32;
  static constexpr bool OFFSET = false;
  static constexpr int64_t TILE_BYTES = 64 * TILE;
  static constexpr int64_t ROW_BY_ROW = 1;

  template <class Use>
  static void subs(const uint8_t *block, int c, Use use) {
    use(Group<1, vf>{{0}, {broadcast(1.f)}, {vf{}}}, [&](auto each) {
#pragma GCC unroll 8
      for (int i = 0; i < 32; ++i) each(i, {Load(field(block, 0, 2, c, i))});
    });
  }
};

using F16 = Float16Bits<1, packed::load_half>;
using BF16 = Float16Bits<30, packed::load_bf16>;

}  // namespace formats
