"""GGUF matrices kept in their format (agent/model/quantized.py): every kernel format packs to exactly
the file's size and back, dequantizes as the gguf package does, and Q4_1's packed layout unpacked by
hand is the matrix."""

import gguf
import numpy as np
import pytest

from agent.model.quantized import FIELDS, TILE, BlockMatrix
from tools.make_gguf import random_blocks


@pytest.mark.parametrize("qtype", sorted(FIELDS, key=lambda t: t.value), ids=lambda t: t.name)
def test_every_format_packs_to_the_files_size_and_back(qtype):
    rng = np.random.default_rng(qtype.value)
    raw = random_blocks(qtype, 40, 512, rng)
    matrix = BlockMatrix.from_gguf(qtype, raw, 512)
    assert matrix.shape == (40, 512) and matrix.packed.shape[0] == 2
    assert matrix.nbytes == raw.nbytes * 64 // 40  # two tiles of 32 rows, the last padded
    np.testing.assert_array_equal(matrix.raw(), raw)
    want = np.asarray(gguf.quants.dequantize(raw, qtype), np.float32)
    np.testing.assert_array_equal(matrix.dequantize(), want)
    reversed_rows = BlockMatrix.from_gguf(qtype, raw, 512, reorder=lambda a: a[::-1])
    np.testing.assert_array_equal(reversed_rows.dequantize(), want[::-1])


@pytest.mark.parametrize("rows", [64, 40])  # a whole number of tiles, and a padded last tile
def test_q4_1_packed_layout_unpacks_to_the_matrix(rows):
    qtype = gguf.GGMLQuantizationType.Q4_1
    raw = gguf.quants.quantize(np.random.default_rng(1).standard_normal((rows, 64)).astype(np.float32), qtype)
    want = gguf.quants.dequantize(raw, qtype)
    packed = BlockMatrix.from_gguf(qtype, raw, 64).packed
    tiles = -(-rows // TILE)
    assert packed.shape == (tiles, 2, 640) and packed.dtype == np.uint8
    d = packed[..., : 2 * TILE].copy().view(np.float16).astype(np.float32)  # [tiles, blocks, TILE]
    m = packed[..., 2 * TILE : 4 * TILE].copy().view(np.float16).astype(np.float32)
    nibbles = packed[..., 4 * TILE :].reshape(tiles, 2, 16, TILE)
    q = np.concatenate([nibbles & 15, nibbles >> 4], axis=2)  # [tiles, blocks, k, TILE]
    dense = d[:, :, None, :] * q + m[:, :, None, :]  # weight (k, column) per tile and block
    unpacked = dense.transpose(0, 3, 1, 2).reshape(tiles * TILE, 64)
    np.testing.assert_array_equal(unpacked[:rows], want)
    assert not unpacked[rows:].any()


def test_float_matrices_pack_as_float32_tiles():
    w = np.random.default_rng(2).standard_normal((40, 24)).astype(np.float32)
    matrix = BlockMatrix.from_float(w)
    assert matrix.packed.shape == (2, 24, TILE) and matrix.packed.dtype == np.float32
    np.testing.assert_array_equal(matrix.dequantize(), w)
