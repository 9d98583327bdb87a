"""GGUF's Q4_1 matrices kept quantized, for the fused layer kernel's products (agent/kernels/
packed_matmul.h, namespace q4): a decode step reads 0.75 bytes a weight instead of fp32's 4. The
values are exactly gguf.quants.dequantize's: weight = d * q + m."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

BLOCK = 32  # weights along the input dimension per block
TILE = 32  # output columns per packed tile (packed_matmul.h)
Q4_1_BYTES = 20  # d and m as float16, 16 bytes of nibbles


@dataclass(frozen=True)
class Q4Matrix:
    """A [rows, cols] matrix as Q4_1 blocks along cols: scales d and offsets m [rows, cols / 32]
    (float32), quants q [rows, cols / 32, 32] (0..15, in column order)."""

    d: np.ndarray
    m: np.ndarray
    q: np.ndarray

    @classmethod
    def from_gguf(cls, raw: np.ndarray) -> Q4Matrix:
        """GGUF Q4_1 tensor data [rows, blocks * 20] uint8 -> the blocks unpacked."""
        blocks = raw.reshape(raw.shape[0], -1, Q4_1_BYTES)
        d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
        m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
        nibbles = blocks[..., 4:]  # byte j holds weight j (low nibble) and weight j + 16 (high)
        return cls(d, m, np.concatenate([nibbles & 15, nibbles >> 4], axis=-1))

    @property
    def shape(self) -> tuple[int, int]:
        return self.q.shape[0], self.q.shape[1] * BLOCK

    def dequantize(self) -> np.ndarray:
        return (self.d[..., None] * self.q + self.m[..., None]).reshape(self.shape)

    def rows(self, index) -> Q4Matrix:
        return Q4Matrix(self.d[index], self.m[index], self.q[index])

    def reorder_rows(self, reorder) -> Q4Matrix:
        """`reorder` (a function of an array over rows, like formats.gguf_file.unpermute_qk) on every part."""
        return Q4Matrix(reorder(self.d), reorder(self.m), reorder(self.q))

    def scaled(self, factor: float) -> Q4Matrix:
        return Q4Matrix(self.d * np.float32(factor), self.m * np.float32(factor), self.q)

    @staticmethod
    def stack(parts: list[Q4Matrix]) -> Q4Matrix:
        return Q4Matrix(*(np.concatenate([getattr(p, f) for p in parts]) for f in ("d", "m", "q")))

    def pack(self) -> np.ndarray:
        """The kernel's layout, rows as output columns: [ceil(rows / TILE), blocks, 768] uint8; per tile
        and block d[TILE] and m[TILE] as float32, then byte (i, t) = q[i][t] | q[i + 16][t] << 4."""
        rows, blocks = self.d.shape
        tiles = -(-rows // TILE)
        pad = tiles * TILE - rows
        d, m = (
            np.pad(a, ((0, pad), (0, 0))).reshape(tiles, TILE, blocks).transpose(0, 2, 1)
            for a in (self.d, self.m)
        )
        q = (
            np.pad(self.q, ((0, pad), (0, 0), (0, 0)))
            .reshape(tiles, TILE, blocks, BLOCK)
            .transpose(0, 2, 3, 1)
        )
        nibbles = (q[:, :, : BLOCK // 2] | (q[:, :, BLOCK // 2 :] << 4)).astype(np.uint8)
        return np.concatenate(
            [
                np.ascontiguousarray(d, np.float32).view(np.uint8),
                np.ascontiguousarray(m, np.float32).view(np.uint8),
                nibbles.reshape(tiles, blocks, -1),
            ],
            axis=-1,
        )


Q8_0_BYTES = 34  # d as float16, 32 int8 quants


@dataclass(frozen=True)
class Q8Matrix:
    """A [rows, cols] matrix as GGUF Q8_0 blocks along cols: scales d [rows, cols / 32] (float32),
    quants q [rows, cols / 32, 32] (int8); weight = d * q. The default model's tied embedding is
    Q8_0: as the LM head it is read every decode step, 1.06 bytes a weight instead of fp32's 4."""

    d: np.ndarray
    q: np.ndarray

    @classmethod
    def from_gguf(cls, raw: np.ndarray) -> Q8Matrix:
        """GGUF Q8_0 tensor data [rows, blocks * 34] uint8 -> the blocks unpacked."""
        blocks = raw.reshape(raw.shape[0], -1, Q8_0_BYTES)
        d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
        return cls(d, blocks[..., 2:].copy().view(np.int8))

    @property
    def shape(self) -> tuple[int, int]:
        return self.q.shape[0], self.q.shape[1] * BLOCK

    def dequantize(self) -> np.ndarray:
        return (self.d[..., None] * self.q).reshape(self.shape)

    def pack(self) -> np.ndarray:
        """The kernel's layout (packed_matmul.h q8), rows as output columns: [ceil(rows / TILE),
        blocks, 1152] uint8; per tile and block d[TILE] as float32, then byte (i, t) = q[t][i]."""
        rows, blocks = self.d.shape
        tiles = -(-rows // TILE)
        pad = tiles * TILE - rows
        d = np.pad(self.d, ((0, pad), (0, 0))).reshape(tiles, TILE, blocks).transpose(0, 2, 1)
        q = np.pad(self.q, ((0, pad), (0, 0), (0, 0)))
        q = q.reshape(tiles, TILE, blocks, BLOCK).transpose(0, 2, 3, 1)
        return np.concatenate(
            [np.ascontiguousarray(d, np.float32).view(np.uint8), q.reshape(tiles, blocks, -1).view(np.uint8)],
            axis=-1,
        )
