// What every weight format (one header each, beside this one) provides to the products
// (packed_matmul.h), and where a file's block lands in the packed layout.
//
// Packed layout (agent/model/quantized.py pack): a matrix of N rows (the product's output columns)
// and K columns, as [N / TILE, K / BLOCK, TILE_BYTES] bytes: per tile of TILE rows and block of BLOCK
// k, the TILE file blocks, each field of the file's block (in the file's order) stored as
// [elements][TILE][element bytes], so that one element of a vector of LANES columns is one load.
// TILE_BYTES = TILE x the file's block bytes: the packed matrix is exactly the file's size.
//
// A format is a struct with
//   ID          GGML's type number (gguf.GGMLQuantizationType), the format id the ops take;
//   BLOCK, SUB  k positions of a block, and of a sub-block that shares one scale (and offset);
//   OFFSET      whether weights have an offset: weight = scale * q + offset (else scale * q);
//   TILE_BYTES  a tile's block;
//   ROW_BY_ROW  up to how many rows a call is faster a row at a time than straight from the blocks;
//   subs(block, c, use): for each group of N sub-blocks of a tile's block that share the file's
//     bytes (N = 1, 2 or 4: a byte's two nibbles, or four 2-bit fields, belong to other sub-blocks),
//     column vector c (LANES columns): use(group, quants), group a Group<N> (its sub-blocks s[n],
//     their scale[n] and offset[n]); quants(each) calls each(i, q) for every i in [0, SUB), q[n] the
//     quants of k = s[n] * SUB + i (Group::Quant: integers, the quantized formats, as vi; else
//     the weights as vf, F16 and BF16). Scale and offset are float32, formed from
//     the file's values as gguf.quants.dequantize forms them (d * sc in float32, never rounded to
//     half), so the products are float32 products with the dequantized matrix. A group's bytes are
//     read and unpacked once for its N sub-blocks (Q4_K's nibbles, Q6_K's high bits).
//     The integer formats' quants also read four k at a time: quants.quads(each) calls each(g, q),
//     q[n] holding in lane t the quants of k = s[n] * SUB + 4 g .. + 3 of column t as bytes
//     (packed::quad's layout; the low 8 bits: Q8_0's are int8), for every g in [0, SUB / 4): the
//     int8 products' operands (int8_products.h), read from the blocks without unpacking them.
#pragma once

#include <cstdint>

#include "../lanes.h"

namespace formats {

using packed::broadcast;
using packed::LANES;
using packed::TILE;
using packed::to_float;
using packed::vf;
using packed::vi;

template <int N, class Q = vi>
struct Group {
  using Quant = Q;
  int s[N];
  vf scale[N], offset[N];
};

// A group's quants, per k (operator()) and four k at a time (quads), from one read of the scales.
template <class PerK, class PerQuad>
struct Quants {
  PerK per_k;
  PerQuad per_quad;
  template <class Each>
  void operator()(Each each) const { per_k(each); }
  template <class Each>
  void quads(Each each) const { per_quad(each); }
};
template <class PerK, class PerQuad>
Quants<PerK, PerQuad> quants(PerK per_k, PerQuad per_quad) {
  return {per_k, per_quad};
}

// Bytes b of each lane of quad-layout quants (packed::quad): bit b of h's low four bits (Q5_0's
// fifth bits of four k, one bit each, spread to their bytes: bit b moves to bit 8 b).
inline vi spread_bits(vi h) { return ((h & 15) * 0x00204081) & 0x01010101; }

// Four k of byte quants in each lane: their low and high nibbles.
constexpr int32_t NIBBLES = 0x0F0F0F0F;

// Element u of column vector c of the file's field at byte `offset` (of `element`-byte values).
inline const uint8_t *field(const uint8_t *block, int offset, int element, int c, int u = 0) {
  return block + offset * TILE + (u * TILE + c * LANES) * element;
}

}  // namespace formats
