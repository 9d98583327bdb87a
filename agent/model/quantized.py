"""Weight matrices kept in their file's format for the CPU kernels' products (agent/kernels/product.h):
a GGUF's blocks rearranged into column tiles, byte for byte (the packed matrix is the file's size),
so that a decode step reads 0.5-2 bytes a weight instead of float32's 4. The values are exactly
gguf.quants.dequantize's; `dequantize()` gives them as float32 for the paths without the kernels.

An int8 checkpoint's per-channel matrices (agent/model/formats/int8_checkpoint.py) become Q8_0 blocks
with their int8 values as they are (`BlockMatrix.from_int8`), and `Int8Linear` keeps what Ascend's
quantized products take beside them.

Packed layout (agent/kernels/formats/format.h): a matrix of N rows (the product's output columns) and
K columns as [ceil(N / TILE), K / BLOCK, TILE x the block's bytes]: per tile of TILE rows and block,
each field of the file's block stored as [elements][TILE][element bytes]. Float32 matrices are
[ceil(N / TILE), K, TILE] float32.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

TILE = 32  # output columns per packed tile (agent/kernels/lanes.h)
F32 = GGMLQuantizationType.F32
Q8_0 = GGMLQuantizationType.Q8_0
Q8_0_BLOCK = 32
# float16's normal range: a Q8_0 scale in it is the float32 scale to 2^-11 relative; below it the
# spacing is fixed (2^-24), so a smaller scale would lose more and 0 would lose the row
F16_NORMAL = (2.0**-14, 65504.0)

# Each format the kernels multiply (agent/kernels/formats/): its block's fields as (byte offset,
# bytes, bytes an element), in the file's order. F16 and BF16 go in blocks of 32 weights.
FIELDS: dict[GGMLQuantizationType, tuple[tuple[int, int, int], ...]] = {
    GGMLQuantizationType.Q4_0: ((0, 2, 2), (2, 16, 1)),
    GGMLQuantizationType.Q4_1: ((0, 2, 2), (2, 2, 2), (4, 16, 1)),
    GGMLQuantizationType.Q5_0: ((0, 2, 2), (2, 4, 4), (6, 16, 1)),
    GGMLQuantizationType.Q5_1: ((0, 2, 2), (2, 2, 2), (4, 4, 4), (8, 16, 1)),
    GGMLQuantizationType.Q8_0: ((0, 2, 2), (2, 32, 1)),
    GGMLQuantizationType.Q2_K: ((0, 16, 1), (16, 64, 1), (80, 2, 2), (82, 2, 2)),
    GGMLQuantizationType.Q3_K: ((0, 32, 1), (32, 64, 1), (96, 12, 1), (108, 2, 2)),
    GGMLQuantizationType.Q4_K: ((0, 2, 2), (2, 2, 2), (4, 12, 1), (16, 128, 1)),
    GGMLQuantizationType.Q5_K: ((0, 2, 2), (2, 2, 2), (4, 12, 1), (16, 32, 1), (48, 128, 1)),
    GGMLQuantizationType.Q6_K: ((0, 128, 1), (128, 64, 1), (192, 16, 1), (208, 2, 2)),
    GGMLQuantizationType.F16: ((0, 64, 2),),
    GGMLQuantizationType.BF16: ((0, 64, 2),),
}
KERNEL_TYPES = frozenset(FIELDS)
FLOAT16_TYPES = (GGMLQuantizationType.F16, GGMLQuantizationType.BF16)


def block_shape(qtype: GGMLQuantizationType) -> tuple[int, int]:
    """(weights, bytes) of one block as the kernels take it (F16 and BF16: 32 weights)."""
    if qtype in FLOAT16_TYPES:
        return 32, 64
    return GGML_QUANT_SIZES[qtype]


def has_kernel(qtype: GGMLQuantizationType, cols: int) -> bool:
    """The kernels multiply a matrix of this type with rows of `cols` weights."""
    return qtype in KERNEL_TYPES and cols % block_shape(qtype)[0] == 0


@dataclass(frozen=True)
class BlockMatrix:
    """A [rows, cols] matrix packed for the kernels (module docstring); qtype F32 for float32."""

    qtype: GGMLQuantizationType
    shape: tuple[int, int]
    packed: np.ndarray

    @classmethod
    def from_gguf(
        cls, qtype: GGMLQuantizationType, raw: np.ndarray, cols: int, reorder: Callable | None = None
    ) -> BlockMatrix:
        """GGUF tensor data [rows, row bytes] (uint8) of a kernel type; `reorder`: a function of an
        array over rows (formats.gguf_file.unpermute_qk) applied to the rows first."""
        raw = np.asarray(raw).reshape(len(raw), -1).view(np.uint8)
        if reorder is not None:
            raw = reorder(raw)
        return cls(qtype, (len(raw), cols), _pack_blocks(qtype, raw))

    @classmethod
    def from_float(cls, w: np.ndarray) -> BlockMatrix:
        """A float32 [rows, cols] matrix as float32 tiles [ceil(rows / TILE), cols, TILE]."""
        rows, cols = w.shape
        tiles = -(-rows // TILE)
        padded = np.zeros((tiles * TILE, cols), np.float32)
        padded[:rows] = w
        return cls(
            F32, (rows, cols), np.ascontiguousarray(padded.reshape(tiles, TILE, cols).transpose(0, 2, 1))
        )

    @classmethod
    def from_int8(cls, quants: np.ndarray, scales: np.ndarray) -> BlockMatrix:
        """An int8 [rows, cols] matrix with one float scale a row (w = q * s) as Q8_0: every block of
        a row takes the row's scale as its float16 `d` and the int8 values as they are. A scale is
        then rounded to float16 (2^-11 relative within F16_NORMAL, exact for a bfloat16 one); the
        caller keeps matrices whose scales leave that range in float32."""
        rows, cols = quants.shape
        blocks = cols // Q8_0_BLOCK
        d = np.repeat(np.asarray(scales, "<f2").reshape(rows, 1, 1), blocks, axis=1)
        raw = np.concatenate(
            [d.view(np.uint8), np.asarray(quants, np.int8).reshape(rows, blocks, Q8_0_BLOCK).view(np.uint8)],
            axis=2,
        )
        return cls.from_gguf(Q8_0, raw.reshape(rows, -1), cols)

    def int8_quants(self) -> np.ndarray:
        """A Q8_0 matrix's int8 values [rows, cols] (its blocks' scales left out)."""
        rows, cols = self.shape
        raw = self.raw().reshape(rows, cols // Q8_0_BLOCK, 2 + Q8_0_BLOCK)
        return np.ascontiguousarray(raw[:, :, 2:]).view(np.int8).reshape(rows, cols)

    @property
    def nbytes(self) -> int:
        return self.packed.nbytes

    def raw(self) -> np.ndarray:
        """The file's blocks again, [rows, row bytes] uint8 (not for F32)."""
        fields = FIELDS[self.qtype]
        tiles, blocks, _ = self.packed.shape
        size = fields[-1][0] + fields[-1][1]
        out = np.empty((tiles, TILE, blocks, size), np.uint8)
        for offset, n, element in fields:
            part = self.packed[:, :, offset * TILE : (offset + n) * TILE]
            part = part.reshape(tiles, blocks, n // element, TILE, element).transpose(0, 3, 1, 2, 4)
            out[..., offset : offset + n] = part.reshape(tiles, TILE, blocks, n)
        return out.reshape(tiles * TILE, blocks * size)[: self.shape[0]]

    def dequantize(self) -> np.ndarray:
        """The matrix as float32 [rows, cols], exactly as gguf.quants.dequantize gives the file's."""
        if self.qtype == F32:
            tiles = self.packed.shape[0]
            return self.packed.transpose(0, 2, 1).reshape(tiles * TILE, -1)[: self.shape[0]]
        import gguf

        raw = self.raw()
        return np.asarray(gguf.quants.dequantize(raw, self.qtype), np.float32).reshape(self.shape)


def _pack_blocks(qtype: GGMLQuantizationType, raw: np.ndarray) -> np.ndarray:
    """[rows, row bytes] of a kernel type -> [ceil(rows / TILE), blocks, TILE x block bytes]."""
    fields = FIELDS[qtype]
    size = fields[-1][0] + fields[-1][1]
    rows = len(raw)
    tiles, blocks = -(-rows // TILE), raw.shape[1] // size
    if rows % TILE:  # zero rows: blocks whose scales are 0
        raw = np.concatenate([raw, np.zeros((tiles * TILE - rows, raw.shape[1]), np.uint8)])
    source = raw.reshape(tiles, TILE, blocks, size)
    out = np.empty((tiles, blocks, TILE * size), np.uint8)
    for offset, n, element in fields:
        part = source[..., offset : offset + n].reshape(tiles, TILE, blocks, n // element, element)
        target = out[:, :, offset * TILE : (offset + n) * TILE].reshape(
            tiles, blocks, n // element, TILE, element
        )
        target[...] = part.transpose(0, 2, 3, 1, 4)
    return out


@dataclass(frozen=True, kw_only=True)
class Int8Linear:
    """An int8 checkpoint's linear beyond its int8 weights q [out, in] (Checkpoint.int8_weight): what
    Ascend's quantized products take (agent/graphs/quant_matmul.py). `scheme`:

    - "static" (msModelSlim W8A8): xq = clamp(round(x / input_scale + input_offset), -128, 127),
      y = (xq @ q^T + quant_bias) * deq_scale;
    - "dynamic" (msModelSlim W8A8_DYNAMIC, compressed-tensors int8 with dynamic per-token activations):
      per row t = max |x| / 127, y = (round(x / t) @ q^T) * weight_scale * t;
    - "weight_only" (msModelSlim W8A16, compressed-tensors int8 weights alone): y = x @ (q * weight_scale)^T.

    weight_scale is each output row's float scale in all three (static: deq_scale / input_scale), so
    that q * weight_scale is the float matrix the CPU multiplies."""

    scheme: str
    weight_scale: np.ndarray = field(repr=False)  # float32 [out]
    deq_scale: np.ndarray | None = field(default=None, repr=False)  # float32 [out], static
    quant_bias: np.ndarray | None = field(default=None, repr=False)  # int32 [out], static
    input_scale: float = 1.0  # static
    input_offset: float = 0.0  # static, an int8 value
