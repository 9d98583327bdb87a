"""The decode attention over a paged KV cache (agent/kernels/row_ops.h attend_paged, through
DecodeAttention) called straight with ctypes, against numpy's softmax(q . K) . V in float64: query
heads beyond one key pass (4), head dims that are no multiple of 8, blocks of 1 to 32 positions,
lengths from 0 to past the blocks prefetched ahead, partial last blocks, shuffled block tables, and
scores that grow from block to block (each new block raises the running maximum the online softmax
rescales by)."""

import ctypes

import numpy as np
import pytest

from agent.kernels import build
from kernel_calls import call


@pytest.fixture
def library(kernel_target):
    return ctypes.CDLL(str(build(kernel_target)))


def reference(q, k_cache, v_cache, tables, block, lengths, kv) -> np.ndarray:
    out = np.zeros(q.shape, np.float64)
    for n, length in enumerate(lengths):
        if length == 0:
            continue  # nothing to attend: zeros
        positions = np.arange(length)
        blocks = tables[n // kv][positions // block].astype(np.int64)
        rows = (blocks * kv + n % kv) * block + positions % block
        keys, values = k_cache[rows].astype(np.float64), v_cache[rows].astype(np.float64)
        scores = q[n].astype(np.float64) @ keys.T  # [groups, length]
        weights = np.exp(scores - scores.max(axis=1, keepdims=True))
        out[n] = (weights / weights.sum(axis=1, keepdims=True)) @ values
    return out


@pytest.mark.parametrize(
    "groups, hd, block, kv",
    [(3, 64, 16, 3), (5, 12, 4, 2), (1, 8, 1, 1), (9, 128, 32, 1), (2, 20, 8, 2)],
    ids=lambda v: str(v),
)
def test_attention_over_shuffled_blocks_matches_numpy(library, groups, hd, block, kv):
    rng = np.random.default_rng(groups * 1000 + hd)
    lengths_per_row = [0, 1, 7, 8, 9, block, block + 1, 3 * block, 5 * block - 3, 2 * block + 8, 77, 130]
    rows = len(lengths_per_row)  # >= 8 (sequence, KV head) rows: the thread team shares them
    entries = -(-max(lengths_per_row) // block)
    pool = rows * entries + 3
    tables = rng.permutation(pool)[: rows * entries].reshape(rows, entries).astype(np.int32)
    cache_rows = pool * kv * block
    keys = rng.standard_normal((cache_rows, hd)).astype(np.float32)
    # Keys grow with their position in the pool's rows, so later blocks often hold larger scores.
    keys *= (1 + 3 * rng.random((cache_rows, 1))).astype(np.float32)
    values = rng.standard_normal((cache_rows, hd)).astype(np.float32)
    q = (rng.standard_normal((rows * kv, groups, hd)) * 0.6).astype(np.float32)
    lengths = np.repeat(np.asarray(lengths_per_row, np.int32), kv)
    out = np.full(q.shape, np.nan, np.float32)
    block_size = np.array([block], np.int32)
    assert call(library.DecodeAttention, [q, keys, values, tables, block_size, lengths], out) == 0
    want = reference(q, keys, values, tables, block, lengths, kv)
    np.testing.assert_allclose(out, want, rtol=1e-4, atol=1e-5)


def test_a_table_reaching_outside_the_cache_is_refused(library):
    """A length past the table's blocks, or a block id past the pool, returns 1 and writes nothing."""
    hd, block = 16, 4
    keys = values = np.zeros((2 * block, hd), np.float32)
    q = np.zeros((1, 1, hd), np.float32)
    for table, length in ((np.array([[0]], np.int32), block + 1), (np.array([[0, 2]], np.int32), block + 1)):
        out = np.full(q.shape, np.nan, np.float32)
        args = [q, keys, values, table, np.array([block], np.int32), np.array([length], np.int32)]
        assert call(library.DecodeAttention, args, out) == 1
        assert np.isnan(out).all()
