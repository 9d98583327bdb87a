"""GGUF Q4_1 blocks kept quantized (agent/quantized.py): the values, and the kernel's packed layout,
against the gguf package's own dequantizer and an unpacking by hand."""

import numpy as np
import pytest

from agent.model.quantized import BLOCK, TILE, Q4Matrix

pytestmark = pytest.mark.unit


def random_q4(rows: int, blocks: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """GGUF Q4_1 bytes [rows, blocks * 20] and the gguf package's dequantization of them."""
    import gguf

    rng = np.random.default_rng(seed)
    dense = rng.standard_normal((rows, blocks * BLOCK)).astype(np.float32)
    raw = gguf.quants.quantize(dense, gguf.GGMLQuantizationType.Q4_1)
    return raw, gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.Q4_1)


def test_blocks_dequantize_like_gguf():
    raw, want = random_q4(40, 3)
    matrix = Q4Matrix.from_gguf(raw)
    assert matrix.shape == (40, 96)
    np.testing.assert_array_equal(matrix.dequantize(), want)
    np.testing.assert_array_equal(matrix.rows(slice(5, 9)).dequantize(), want[5:9])
    np.testing.assert_allclose(matrix.scaled(0.125).dequantize(), want * 0.125, rtol=1e-6)
    both = Q4Matrix.stack([matrix, matrix.rows(slice(0, 2))])
    np.testing.assert_array_equal(both.dequantize(), np.concatenate([want, want[:2]]))


@pytest.mark.parametrize("rows", [64, 40])  # a whole number of tiles, and a padded last tile
def test_packed_layout_unpacks_to_the_matrix(rows):
    raw, want = random_q4(rows, 2, seed=1)
    packed = Q4Matrix.from_gguf(raw).pack()
    tiles = -(-rows // TILE)
    assert packed.shape == (tiles, 2, 768) and packed.dtype == np.uint8
    d = packed[..., : 4 * TILE].copy().view(np.float32)  # [tiles, blocks, TILE]
    m = packed[..., 4 * TILE : 8 * TILE].copy().view(np.float32)
    nibbles = packed[..., 8 * TILE :].reshape(tiles, 2, BLOCK // 2, TILE)
    q = np.concatenate([nibbles & 15, nibbles >> 4], axis=2)  # [tiles, blocks, k, TILE]
    dense = d[:, :, None, :] * q + m[:, :, None, :]  # weight (k, column) per tile and block
    unpacked = dense.transpose(0, 3, 1, 2).reshape(tiles * TILE, 2 * BLOCK)
    np.testing.assert_array_equal(unpacked[:rows], want)
    assert not unpacked[rows:].any()
