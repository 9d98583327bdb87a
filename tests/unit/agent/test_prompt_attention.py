"""The prompt-attention path of the fused layer (agent/kernels/prompt_attention.h, through FusedStack
of one layer) called straight with ctypes: rows sharing one block table attend in blocks that share
each cache block's loads, and must give bit for bit what the same rows give one by one (row_ops.h
attend_paged, a decode row's) and in blocks of other sizes, whatever each KV head's length, and in
a sliding-window layer whatever part of the positions each row's window leaves out: a row's result
may not depend on the rows beside it (a prompt's chunking, a prefix-cache hit, issue 58)."""

import ctypes

import numpy as np
import pytest

from agent.kernels import build
from kernel_calls import call, packed


@pytest.fixture
def library(kernel_target):
    return ctypes.CDLL(str(build(kernel_target)))


def fused_layer(
    library,
    lengths: np.ndarray,
    row_table: np.ndarray,
    tables: np.ndarray,
    window: int = 0,
    bidirectional: bool = False,
    x_changed_at: int | None = None,
) -> tuple[np.ndarray, int]:
    """One FusedStack call of one layer over 8 rows with 2 KV heads of 32 (one query head each); the
    same weights, inputs and cache on every call; `window`: the layer's sliding window (its rows then
    also QK-normed, post-normed and GeGLU, as Gemma's are); `bidirectional`: an encoder's layer;
    `x_changed_at`: that row's input other than on every other call. (output, return code)"""
    rng = np.random.default_rng(7)
    rows, dim, hd, kv, heads, ffn, block = 8, 32, 32, 2, 2, 32, 4
    pool = 24

    def normal(*shape, scale=0.3):
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    x = normal(rows, dim, scale=1.0)
    if x_changed_at is not None:
        x[x_changed_at] += 1.0
    qkv_width = (heads + 2 * kv) * hd
    angles = rng.random((rows, 1, hd)).astype(np.float32)
    cache_rows = pool * kv * block
    k_cache, v_cache = normal(cache_rows, hd, scale=1.0), normal(cache_rows, hd, scale=1.0)
    # each (row, KV head) writes its newest position, lengths - 1, through its row's table
    n = np.arange(rows * kv)
    position = lengths - 1
    table = tables[row_table[n // kv]]
    write = ((table[n, position // block] * kv + n % kv) * block + position % block).astype(np.int32)
    common = [
        x,
        np.cos(angles),
        np.sin(angles),
        write,
        lengths.astype(np.int32),
        np.array([1e-5], np.float32),
        tables.astype(np.int32),
        row_table.astype(np.int32),
        np.array([block], np.int32),
    ]
    common += [common[1], common[2], common[3], common[6]]  # no sliding-window layer's own
    common.append(np.zeros(1, np.int32))  # no Gated DeltaNet layer's state slots
    layer = [
        np.ones(dim, np.float32),
        normal(qkv_width, scale=0.1),
        k_cache,
        v_cache,
        np.ones(dim, np.float32),
        np.zeros(7, np.int32),  # every matrix float32 (product.h F32)
        packed(normal(dim, heads * hd)),
        packed(normal(dim, kv * hd)),
        packed(normal(dim, kv * hd)),
        packed(normal(heads * hd, dim)),
        packed(normal(dim, ffn)),
        packed(normal(dim, ffn)),
        packed(normal(ffn, dim)),
    ]
    gemma = int(window > 0)
    layer += [1 + normal(hd), 1 + normal(hd), 1 + normal(dim), 1 + normal(dim)]  # read by a Gemma layer
    layer.append(np.array([window, 0, gemma, gemma, gemma, 0, 0, 0, int(bidirectional)], np.int32))
    arrays = common + layer
    out = np.full((rows, dim), np.nan, np.float32)
    return out, call(library.FusedStack, arrays, out)


def test_a_run_sizes_its_scratch_from_its_longest_kv_head(library):
    """Eight rows of one sequence (a prompt-attention run) whose second KV head attends 32 positions
    more than the first: the run's packed keys and each block's scores must span the longer head.
    Sized from the first head's lengths (as before), the second head's softmax ran past its row of
    scores and attended positions that were never packed."""
    rows, entries = 8, 12
    lengths = np.stack([np.arange(1, rows + 1), np.arange(33, 33 + rows)], axis=1).reshape(-1)
    one_table = np.random.default_rng(3).permutation(16)[:entries]
    as_run, code = fused_layer(library, lengths, np.zeros(rows, np.int32), one_table[None, :])
    assert code == 0
    # The same rows, each through its own copy of the table: too short for a run, one row at a time.
    one_by_one, code = fused_layer(library, lengths, np.arange(rows), np.tile(one_table, (rows, 1)))
    assert code == 0
    assert np.isfinite(one_by_one).all()
    np.testing.assert_array_equal(as_run, one_by_one)


@pytest.mark.parametrize("window", [1, 5, 30, 40])
def test_a_run_in_a_sliding_window_attends_as_its_rows_one_by_one(library, window):
    """Rows at positions 33..40 of one sequence, a second KV head 32 positions further: with a window
    of 5 each row attends its last 5 positions (the run packs from the earliest any row reads); a
    window longer than some rows' lengths attends all they have."""
    rows, entries = 8, 20
    lengths = np.stack([np.arange(33, 33 + rows), np.arange(65, 65 + rows)], axis=1).reshape(-1)
    one_table = np.random.default_rng(4).permutation(20)[:entries]
    as_run, code = fused_layer(library, lengths, np.zeros(rows, np.int32), one_table[None, :], window)
    assert code == 0
    one_by_one, code = fused_layer(library, lengths, np.arange(rows), np.tile(one_table, (rows, 1)), window)
    assert code == 0 and np.isfinite(one_by_one).all()
    np.testing.assert_array_equal(as_run, one_by_one)
    whole, _ = fused_layer(library, lengths, np.arange(rows), np.tile(one_table, (rows, 1)), 10_000)
    assert not np.allclose(whole, one_by_one, atol=1e-3)  # the window changed what they attend


@pytest.mark.parametrize("window", [0, 6])
@pytest.mark.parametrize("split", [[3, 5], [1, 7], [4, 4], [2, 2, 2, 2], [1, 6, 1]])
def test_a_row_attends_alike_in_blocks_of_every_size(library, split, window):
    """Rows at positions 13..20 of one sequence in blocks of the given sizes (each block its own copy
    of the table, as a prompt chunked at those sizes or after a prefix hit would be: its earlier
    positions already in the cache), against all 8 as one block and each alone: bit-identical. The
    rows' lengths end in different cache blocks (of 4), the second KV head's 16 positions further."""
    rows, entries = 8, 12
    lengths = np.stack([np.arange(14, 14 + rows), np.arange(30, 30 + rows)], axis=1).reshape(-1)
    one_table = np.random.default_rng(5).permutation(16)[:entries]
    whole, code = fused_layer(library, lengths, np.zeros(rows, np.int32), one_table[None, :], window)
    assert code == 0 and np.isfinite(whole).all()
    row_table = np.repeat(np.arange(len(split)), split).astype(np.int32)
    blocks, code = fused_layer(library, lengths, row_table, np.tile(one_table, (len(split), 1)), window)
    assert code == 0
    np.testing.assert_array_equal(blocks, whole)
    one_by_one, code = fused_layer(library, lengths, np.arange(rows), np.tile(one_table, (rows, 1)), window)
    assert code == 0
    np.testing.assert_array_equal(one_by_one, whole)


@pytest.mark.parametrize("window", [0, 3])
def test_a_bidirectional_row_attends_its_prompt_s_later_rows_within_its_window(library, window):
    """An encoder's prompt of 8 rows at positions 0..7 (one KV head's; the other's from 32, as
    above): changing the last row's input changes the first row's output in a bidirectional layer
    (row 0 attends positions 0..7) and not in a causal one. With a window of 3 (two positions either
    side) rows 0..4 stay as they were and the sixth changes (7 - 5 < 3). The same rows over two
    tables are two sequences, neither reading the other."""
    rows, entries = 8, 12
    lengths = np.stack([np.arange(1, rows + 1), np.arange(33, 33 + rows)], axis=1).reshape(-1)
    one_table = np.random.default_rng(6).permutation(16)[:entries]
    table, one = one_table[None, :], np.zeros(rows, np.int32)
    causal, code = fused_layer(library, lengths, one, table, window)
    causal_changed, _ = fused_layer(library, lengths, one, table, window, x_changed_at=rows - 1)
    assert code == 0
    np.testing.assert_array_equal(causal[: rows - 1], causal_changed[: rows - 1])
    both, code = fused_layer(library, lengths, one, table, window, bidirectional=True)
    changed, _ = fused_layer(library, lengths, one, table, window, True, x_changed_at=rows - 1)
    assert code == 0 and np.isfinite(both).all()
    assert not np.allclose(both[:5], causal[:5])  # the earlier rows read the later ones
    assert np.abs(changed[5] - both[5]).max() > 1e-3
    if window:
        np.testing.assert_array_equal(changed[:5], both[:5])  # rows 0..4 do not reach row 7
    else:
        assert np.abs(changed[0] - both[0]).max() > 1e-3
    # blocks of rows [0, 3), [3, 8) of one run: the same bits as one block
    split = np.array([0, 0, 0, 1, 1, 1, 1, 1], np.int32)
    blocks, code = fused_layer(library, lengths, split, np.tile(one_table, (2, 1)), window, True)
    assert code == 0
    assert not np.array_equal(blocks, both)  # two tables: two sequences, neither reading the other
