"""The q8_0 KV cache in the CPU kernels (agent/kernels/kv_rows.h), called straight with ctypes, against
gguf-py's own Q8_0 (gguf.quants, the independent reference): the fused layer writes each new K and V
row as exactly the bytes gguf.quants.quantize gives for it (scales at zero, half subnormals, rounding
ties, signs), and decode attention over a q8_0 cache equals numpy's softmax(q . K) . V over the
cache gguf.quants.dequantize reads, in float64."""

import ctypes

import gguf
import numpy as np
import pytest
from test_decode_attention import reference

from agent.kernels import build
from kernel_calls import call, packed

Q8_0 = gguf.GGMLQuantizationType.Q8_0


@pytest.fixture
def library(kernel_target):
    return ctypes.CDLL(str(build(kernel_target)))


def quantized(rows: np.ndarray) -> np.ndarray:
    """Float rows [R, hd] -> their Q8_0 bytes [R, hd / 32 * 34] (a q8_0 cache's rows)."""
    return np.ascontiguousarray(gguf.quants.quantize(rows.astype(np.float32), Q8_0))


def dequantized(cache: np.ndarray) -> np.ndarray:
    return np.asarray(gguf.quants.dequantize(cache, Q8_0), np.float32)


@pytest.mark.parametrize(
    "groups, hd, block, kv", [(3, 64, 16, 3), (2, 32, 4, 2), (4, 128, 32, 1), (1, 96, 1, 2)]
)
def test_decode_attention_over_a_q8_0_cache_matches_numpy(library, groups, hd, block, kv):
    rng = np.random.default_rng(hd + block)
    lengths_per_row = [0, 1, 7, block, block + 1, 3 * block + 2, 77, 130]
    rows = len(lengths_per_row)
    entries = -(-max(lengths_per_row) // block)
    pool = rows * entries + 3
    tables = rng.permutation(pool)[: rows * entries].reshape(rows, entries).astype(np.int32)
    cache_rows = pool * kv * block
    keys = quantized(rng.standard_normal((cache_rows, hd)) * (1 + 3 * rng.random((cache_rows, 1))))
    values = quantized(rng.standard_normal((cache_rows, hd)))
    assert keys.dtype == np.uint8 and keys.shape == (cache_rows, hd // 32 * 34)
    q = (rng.standard_normal((rows * kv, groups, hd)) * 0.6).astype(np.float32)
    lengths = np.repeat(np.asarray(lengths_per_row, np.int32), kv)
    out = np.full(q.shape, np.nan, np.float32)
    block_size = np.array([block], np.int32)
    assert call(library.DecodeAttention, [q, keys, values, tables, block_size, lengths], out) == 0
    want = reference(q, dequantized(keys), dequantized(values), tables, block, lengths, kv)
    np.testing.assert_allclose(out, want, rtol=1e-4, atol=1e-5)


def test_decode_attention_refuses_a_cache_of_neither_width(library):
    """A uint8 cache whose rows are not hd / 32 Q8_0 blocks (nor hd floats) is refused, not read."""
    hd, block = 64, 4
    q = np.zeros((1, 1, hd), np.float32)
    wrong = np.zeros((4 * block, hd // 32 * 34 + 2), np.uint8)
    args = [q, wrong, wrong, np.zeros((1, 1), np.int32), np.array([block], np.int32), np.array([3], np.int32)]
    assert call(library.DecodeAttention, args, np.zeros_like(q)) == 1


def one_layer(library, k_cache, v_cache, bias, wkv_scale, lengths, tables, identity_rope=False):
    """One FusedStack call of one layer (dim 32, 2 KV heads of 64, one query head each, blocks of 4)
    over len(lengths) decode rows, each with its own table; `bias`: the Q, K and V bias; wk and wv
    scaled by wkv_scale (0: the new K and V rows are their bias, through an identity RoPE where
    identity_rope). (output, return code, the rows written per (row, KV head))"""
    rng = np.random.default_rng(11)
    dim, hd, kv, heads, ffn, block = 32, 64, 2, 2, 32, 4
    rows = len(lengths)

    def normal(*shape, scale=0.3):
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    x = normal(rows, dim, scale=1.0)
    angles = rng.random((rows, 1, hd)).astype(np.float32)
    cos, sin = (
        (np.ones_like(angles), np.zeros_like(angles)) if identity_rope else (np.cos(angles), np.sin(angles))
    )
    n = np.arange(rows * kv)
    lengths = np.repeat(np.asarray(lengths), kv)
    position = lengths - 1
    table = tables[n // kv]
    write = ((table[n, position // block] * kv + n % kv) * block + position % block).astype(np.int32)
    common = [
        x,
        cos,
        sin,
        write,
        lengths.astype(np.int32),
        np.array([1e-5], np.float32),
        tables.astype(np.int32),
    ]
    common += [np.arange(rows, dtype=np.int32), np.array([block], np.int32)]
    common += [common[1], common[2], common[3], common[6], np.zeros(1, np.int32)]  # no state slots
    layer = [
        np.ones(dim, np.float32),
        bias.astype(np.float32),
        k_cache,
        v_cache,
        np.ones(dim, np.float32),
        np.zeros(7, np.int32),
        packed(normal(dim, heads * hd)),
        packed(normal(dim, kv * hd) * wkv_scale),
        packed(normal(dim, kv * hd) * wkv_scale),
        packed(normal(heads * hd, dim)),
        packed(normal(dim, ffn)),
        packed(normal(dim, ffn)),
        packed(normal(ffn, dim)),
    ]
    layer += [np.ones(1, np.float32)] * 4 + [np.zeros(9, np.int32)]
    out = np.full((rows, dim), np.nan, np.float32)
    return out, call(library.FusedStack, common + layer, out), write


def test_the_fused_layer_writes_each_new_row_as_gguf_q8_0_bytes(library):
    """The same call on a float32 cache and on its q8_0 twin: every row the q8_0 call writes is
    gguf's Q8_0 of the row the float32 call writes, byte for byte; the rows it does not write are
    untouched; and the outputs differ only by the quantization."""
    rng = np.random.default_rng(5)
    hd, kv, block, pool = 64, 2, 4, 80
    lengths = [1, 3, 4, 5, 9, 17, 30, 33]
    tables = rng.permutation(pool)[: len(lengths) * 9].reshape(len(lengths), 9)
    start = rng.standard_normal((pool * kv * block, hd)).astype(np.float32)
    k8, v8 = quantized(start), quantized(start[::-1])
    k32, v32 = dequantized(k8), dequantized(v8)  # the float32 run starts from the same values
    bias = rng.standard_normal(6 * hd) * 0.5
    want_out, code, write = one_layer(library, k32, v32, bias, 1.0, lengths, tables)
    assert code == 0
    k_before, v_before = k8.copy(), v8.copy()
    got_out, code, _ = one_layer(library, k8, v8, bias, 1.0, lengths, tables)
    assert code == 0
    np.testing.assert_array_equal(k8[write], quantized(k32[write]))
    np.testing.assert_array_equal(v8[write], quantized(v32[write]))
    untouched = np.setdiff1d(np.arange(len(start)), write)
    np.testing.assert_array_equal(k8[untouched], k_before[untouched])
    np.testing.assert_array_equal(v8[untouched], v_before[untouched])
    assert np.isfinite(got_out).all() and not np.array_equal(got_out, want_out)
    assert np.abs(got_out - want_out).max() < 0.02 * np.abs(want_out).max()


def test_q8_0_rows_of_edge_values_match_gguf(library):
    """K and V rows set through the bias (wk = wv = 0, RoPE the identity): a block of zeros (scale 0),
    scales that are half subnormals or round up into the next binade, rounding ties of q, and mixed
    signs: each row's bytes equal gguf's."""
    hd, kv, block, pool = 64, 2, 4, 8
    rng = np.random.default_rng(9)
    blocks = [
        np.zeros(32),
        rng.standard_normal(32) * 1e-6,  # d ~ 3e-8: a half subnormal
        rng.standard_normal(32) * 3e-9,  # d below half's smallest subnormal: zero
        np.r_[127.0, np.arange(31) - 15.5],  # d = 1: every q but the first is a .5 tie
        np.full(32, 2047.0 * 127 / 2048) * np.sign(rng.standard_normal(32)),
        rng.standard_normal(32) * 300,
        np.r_[np.full(31, 1e-3), -5.0],
        rng.standard_normal(32) * 1e4,
    ]
    bias = np.zeros(6 * hd)
    bias[2 * hd : 6 * hd] = np.concatenate(blocks)  # K of both heads, then V of both heads
    cache = np.zeros((pool * kv * block, hd // 32 * 34), np.uint8)
    k8, v8 = cache.copy(), cache.copy()
    _, code, write = one_layer(library, k8, v8, bias, 0.0, [2], np.arange(2)[None, :], identity_rope=True)
    assert code == 0
    k_rows = bias[2 * hd : 4 * hd].reshape(kv, hd)
    v_rows = bias[4 * hd : 6 * hd].reshape(kv, hd)
    np.testing.assert_array_equal(k8[write], quantized(k_rows))
    np.testing.assert_array_equal(v8[write], quantized(v_rows))
