"""Every weight format's product (agent/kernels/product.h, one header per format in
agent/kernels/formats/) called straight through its C entry points with ctypes, at every kernel
target: each row count from 1 to 64 (a row at a time, straight from the blocks, tiles dequantized
whole), against an fp64 product with gguf.quants.dequantize's matrix of the same file blocks; and an
embedding's rows read from the packed blocks."""

import ctypes

import gguf
import numpy as np
import pytest

from agent.kernels import build, has_int8_products
from agent.model.quantized import FIELDS, BlockMatrix, block_shape
from kernel_calls import call
from reference_numpy import q8_1
from tools.make_gguf import random_blocks

FORMATS = sorted(FIELDS, key=lambda t: t.value)
FLOAT_FORMATS = (gguf.GGMLQuantizationType.F16, gguf.GGMLQuantizationType.BF16)
INTEGER_FORMATS = [t for t in FORMATS if t not in FLOAT_FORMATS]


@pytest.fixture
def library(kernel_target):
    return ctypes.CDLL(str(build(kernel_target)))


def random_matrix(qtype, rows: int, cols: int, seed: int) -> tuple[np.ndarray, BlockMatrix]:
    """A random matrix of `qtype`: gguf's dequantization of its blocks (float64) and its packing."""
    raw = random_blocks(qtype, rows, cols, np.random.default_rng(seed))
    expected = np.asarray(gguf.quants.dequantize(raw, qtype), np.float64).reshape(rows, cols)
    return expected, BlockMatrix.from_gguf(qtype, raw, cols)


def product(library, x: np.ndarray, matrix: BlockMatrix) -> np.ndarray:
    out = np.full((len(x), matrix.packed.shape[0] * 32), np.nan, np.float32)
    format_id = np.array([matrix.qtype.value], np.int32)
    assert call(library.SkinnyMatMulFormat, [x, matrix.packed, format_id], out) == 0
    return out[:, : matrix.shape[0]]


@pytest.mark.parametrize("qtype", FORMATS, ids=lambda t: t.name)
def test_every_row_count_matches_the_dequantized_product(library, qtype):
    """Two blocks of k (K-quants: 512 inputs), 70 rows of weights (a tile of padding columns)."""
    cols = 2 * block_shape(qtype)[0] if block_shape(qtype)[0] > 32 else 96
    w, matrix = random_matrix(qtype, 70, cols, seed=qtype.value)
    assert matrix.nbytes == 3 * 32 * w.shape[1] // block_shape(qtype)[0] * block_shape(qtype)[1]
    rng = np.random.default_rng(1)
    for rows in range(1, 65):
        x = rng.standard_normal((rows, cols)).astype(np.float32)
        want = x.astype(np.float64) @ w.T
        scale = np.abs(want).max()
        got = product(library, x, matrix)
        np.testing.assert_allclose(
            got, want, rtol=1e-4, atol=1e-5 * scale, err_msg=f"{qtype.name}, {rows} rows"
        )


@pytest.mark.parametrize("qtype", FORMATS, ids=lambda t: t.name)
def test_int8_activations_match_the_q8_1_product_at_every_row_count(library, kernel_target, qtype):
    """The opt-in int8 products (int8_products.h, SkinnyMatMulFormatI8): every integer format's
    product with Q8_1-rounded activations is the fp64 product of the rounded activations with the
    dequantized matrix (exact integer sums; only the float scaling rounds), at 1 to 64 rows (row
    blocks of 6 with VNNI, of 3 with AVX2); F16 and BF16 stay float32 products. The portable target
    refuses the call."""
    cols = 2 * block_shape(qtype)[0] if block_shape(qtype)[0] > 32 else 96
    w, matrix = random_matrix(qtype, 70, cols, seed=qtype.value)
    format_id = np.array([qtype.value], np.int32)
    out = np.full((1, matrix.packed.shape[0] * 32), np.nan, np.float32)
    if not has_int8_products(kernel_target):
        x = np.ones((1, cols), np.float32)
        assert call(library.SkinnyMatMulFormatI8, [x, matrix.packed, format_id], out) == 1
        return
    floats = qtype in FLOAT_FORMATS
    rng = np.random.default_rng(2)
    for rows in range(1, 65):
        x = (rng.standard_normal((rows, cols)) * rng.uniform(0.1, 10, (rows, 1))).astype(np.float32)
        want = (x.astype(np.float64) if floats else q8_1(x)) @ w.T
        out = np.full((rows, matrix.packed.shape[0] * 32), np.nan, np.float32)
        assert call(library.SkinnyMatMulFormatI8, [x, matrix.packed, format_id], out) == 0
        np.testing.assert_allclose(
            out[:, :70], want, rtol=1e-4, atol=1e-5 * np.abs(want).max(), err_msg=f"{qtype.name}, {rows} rows"
        )


def test_matrix_rows_are_the_dequantized_rows(library):
    """MatrixRows (a GGUF embedding's lookup) of every format: the rows asked for, exactly."""
    for qtype in FORMATS:
        w, matrix = random_matrix(qtype, 70, block_shape(qtype)[0] * 2, seed=qtype.value + 100)
        ids = np.array([0, 69, 33, 31, 32, 5, 5], np.int32)
        out = np.full((len(ids), w.shape[1]), np.nan, np.float32)
        format_id = np.array([qtype.value], np.int32)
        assert call(library.MatrixRows, [ids, matrix.packed, format_id], out) == 0
        np.testing.assert_allclose(out, w[ids], rtol=1e-6, atol=0, err_msg=qtype.name)
        bad = np.array([0, 96], np.int32)  # past the padded rows
        assert call(library.MatrixRows, [bad, matrix.packed, format_id], out[:2]) == 1


def test_a_shape_that_does_not_fit_the_format_is_refused(library):
    _, matrix = random_matrix(gguf.GGMLQuantizationType.Q4_K, 32, 256, seed=3)
    x = np.ones((1, 256), np.float32)
    out = np.zeros((1, 32), np.float32)
    for format_id in (gguf.GGMLQuantizationType.Q6_K.value, 99):  # another format's block size; unknown
        assert call(library.SkinnyMatMulFormat, [x, matrix.packed, np.array([format_id], np.int32)], out) == 1


@pytest.mark.parametrize("qtype", INTEGER_FORMATS, ids=lambda t: t.name)
def test_a_row_computes_alike_at_every_row_count_and_position(library, kernel_target, qtype):
    """Batch invariance of the int8 products: one input row's output is bit-identical alone and
    inside calls of every row count from 1 to 64 at every position (straight from the blocks up to 4
    rows, from the unpacked tile above, in row blocks of every size), whatever the other rows hold,
    so that a request's tokens do not depend on what else runs in its step. Before, Q2_K, Q3_K and
    Q6_K summed their sub-blocks in another order above 4 rows, and with AVX2 the Q5s' and Q6_K's
    16-bit runs were scaled one by one."""
    cols = 2 * block_shape(qtype)[0] if block_shape(qtype)[0] > 32 else 96
    _, matrix = random_matrix(qtype, 70, cols, seed=qtype.value)
    format_id = np.array([qtype.value], np.int32)
    if not has_int8_products(kernel_target):
        pytest.skip("the portable target has no int8 products")
    rng = np.random.default_rng(3)
    probe = rng.standard_normal((1, cols)).astype(np.float32)
    alone = np.full((1, matrix.packed.shape[0] * 32), np.nan, np.float32)
    assert call(library.SkinnyMatMulFormatI8, [probe, matrix.packed, format_id], alone) == 0
    for rows in range(1, 65):
        others = (rng.standard_normal((rows, cols)) * rng.uniform(0.01, 100, (rows, 1))).astype(np.float32)
        for at in range(rows):
            x = others.copy()
            x[at] = probe[0]
            out = np.full((rows, alone.shape[1]), np.nan, np.float32)
            assert call(library.SkinnyMatMulFormatI8, [x, matrix.packed, format_id], out) == 0
            assert out[at].tobytes() == alone[0].tobytes(), (qtype.name, rows, at)
