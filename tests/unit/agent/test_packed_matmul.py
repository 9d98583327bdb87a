"""The packed-tile product (agent/kernels/packed_matmul.h) called straight through its C entry points
with ctypes: every row count from 1 to past two register blocks, with and without the residual, float32
weights, against numpy in float64; the thread team's split of the tiles (with Q8_0 weights). Every
weight format's products: tests/unit/agent/test_weight_formats.py."""

import ctypes

import numpy as np
import pytest

from agent.kernels import build
from agent.model.quantized import BlockMatrix
from kernel_calls import call as _call

Q8_0 = np.array([8], np.int32)  # the format id (GGML's type number)


def _packed(w: np.ndarray) -> np.ndarray:
    """[K, N] -> [N / 32, K, 32], the layout agent/graphs/layers.py pack_for_kernel writes."""
    k_dim, n_dim = w.shape
    return np.ascontiguousarray(w.reshape(k_dim, n_dim // 32, 32).transpose(1, 0, 2))


def _q8_weights(rng: np.random.Generator, n_dim: int, k_dim: int) -> tuple[np.ndarray, np.ndarray]:
    """Random weights as GGUF Q8_0 blocks: the dequantized matrix [N, K] (float64) and its kernel packing."""
    import gguf

    raw = gguf.quants.quantize(
        rng.standard_normal((n_dim, k_dim)).astype(np.float32), gguf.GGMLQuantizationType.Q8_0
    )
    matrix = BlockMatrix.from_gguf(gguf.GGMLQuantizationType.Q8_0, raw, k_dim)
    return matrix.dequantize().astype(np.float64), matrix.packed


@pytest.fixture
def library(kernel_target):
    return ctypes.CDLL(str(build(kernel_target)))


@pytest.mark.parametrize("k_dim", [40, 96])
def test_every_row_count_matches_numpy(library, k_dim):
    rng = np.random.default_rng(k_dim)
    n_dim = 3 * 32
    w = rng.standard_normal((k_dim, n_dim)).astype(np.float32)
    packed = _packed(w)
    for rows in range(1, 30):
        x = rng.standard_normal((rows, k_dim)).astype(np.float32)
        residual = rng.standard_normal((rows, n_dim)).astype(np.float32)
        expected = x.astype(np.float64) @ w.astype(np.float64)

        out = np.full((rows, n_dim), np.nan, np.float32)
        assert _call(library.SkinnyMatMul, [x, packed], out) == 0
        np.testing.assert_allclose(out, expected, rtol=1e-4, atol=1e-4, err_msg=f"{rows} rows")

        out = np.full((rows, n_dim), np.nan, np.float32)
        assert _call(library.SkinnyMatMulAdd, [x, packed, residual], out) == 0
        np.testing.assert_allclose(out, expected + residual, rtol=1e-4, atol=1e-4, err_msg=f"{rows} rows")


def test_products_called_from_several_threads_at_once_match_numpy(library):
    """MindSpore calls the kernels from more than one thread (agent/kernels/thread_team.h): callers
    share the one team in turn, each gets its own product, none waits forever on a worker that
    missed its region. ctypes releases the GIL during the calls, so they do overlap."""
    from concurrent.futures import ThreadPoolExecutor

    rng = np.random.default_rng(7)
    k_dim, n_dim = 64, 8 * 32
    w = rng.standard_normal((k_dim, n_dim)).astype(np.float32)
    packed = _packed(w)
    inputs = [rng.standard_normal((rows, k_dim)).astype(np.float32) for rows in (1, 3, 8, 17) * 4]

    def product(x: np.ndarray) -> np.ndarray:
        out = np.full((len(x), n_dim), np.nan, np.float32)
        for _ in range(50):
            assert _call(library.SkinnyMatMul, [x, packed], out) == 0
        return out

    with ThreadPoolExecutor(max_workers=4) as pool:
        outputs = list(pool.map(product, inputs))
    for x, out in zip(inputs, outputs, strict=True):
        np.testing.assert_allclose(out, x.astype(np.float64) @ w.astype(np.float64), rtol=1e-4, atol=1e-4)


def test_every_tile_count_is_computed_once(library):
    """The team's loops give each thread a contiguous share of the tiles, taken in chunks of two
    from its front, and a thread done early takes chunks from the back of its mate's
    (thread_team.h for_dynamic): at every tile count (shares of unequal sizes, a last chunk of
    one) each tile is computed: a skipped one stays NaN, and one written by two threads at once
    (a direct tile's rows in blocks, a dequantized tile's in register blocks) is off."""
    rng = np.random.default_rng(3)
    k_dim = 160
    for tiles in [*range(1, 10), 33]:
        n_dim = tiles * 32
        w, packed = _q8_weights(rng, n_dim, k_dim)
        for rows in (1, 5, 16, 40):
            x = rng.standard_normal((rows, k_dim)).astype(np.float32)
            expected = x.astype(np.float64) @ w.T
            for _ in range(20):
                out = np.full((rows, n_dim), np.nan, np.float32)
                assert _call(library.SkinnyMatMulFormat, [x, packed, Q8_0], out) == 0
                where = f"{tiles} tiles, {rows} rows"
                np.testing.assert_allclose(out, expected, rtol=1e-4, atol=1e-4, err_msg=where)


def test_kernels_leave_the_callers_denormal_mode_as_it_was(library):
    """The kernels flush denormals to zero while they run (thread_team.h FlushDenormals), for their
    own threads only: the calling thread (MindSpore's, here numpy's) gets its mode back."""
    tiny = np.float32(1e-30) * np.float32(1e-10)  # 1e-40: a denormal, not flushed here
    assert tiny > 0
    x = np.ones((17, 64), np.float32)
    packed = _packed(np.ones((64, 32), np.float32))
    out = np.zeros((17, 32), np.float32)
    assert _call(library.SkinnyMatMul, [x, packed], out) == 0
    assert np.float32(1e-30) * np.float32(1e-10) > 0
