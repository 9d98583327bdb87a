"""Host-side graph inputs over block tables (agent/graphs/interface.py GraphInputs): the cache rows
each path writes and reads, checked against the layout written out by hand, and the indices refused
before any graph (whose kernels check nothing the host can) sees them."""

import numpy as np
import pytest

from agent.graphs.graph_inputs import MASK_VALUE, prompt_mask
from agent.graphs.interface import GraphInputs, pool_blocks
from config.schema import RuntimeSection

KV, GROUP = 2, 3
RUNTIME = RuntimeSection(
    num_slots=3,
    max_seq_len=40,  # not whole blocks: 3 blocks of 16 per table
    block_size=16,
    prefill_buckets=[8, 32],
    decode_batch_buckets=[1, 4],
    attend_buckets=[16, 40],
    compile_cache_dir=None,
)
FUSED = GraphInputs(RUNTIME, KV, GROUP, fused_layers=True)
MASK = GraphInputs(RUNTIME.model_copy(update={"matmul": "mindspore"}), KV, GROUP, fused_layers=False)
GATHER = GraphInputs(RUNTIME.model_copy(update={"decode_attention": "gather"}), KV, GROUP, fused_layers=False)


def row(table, position: int, head: int, block: int = 16) -> int:
    """The layout, spelled out: block table[p // B], then head, then offset p % B."""
    return (int(table[position // block]) * KV + head) * block + position % block


def test_the_pool_then_the_scratch_blocks_and_fixed_tables_where_the_seats_fit():
    # no budget: each of the 3 slots its whole length (3 blocks), then 2 scratch blocks (32 positions)
    assert FUSED.blocks_per_seq == 3 and FUSED.pool == 9 and FUSED.num_blocks == pool_blocks(RUNTIME) == 11
    assert FUSED.cache_rows == 11 * KV * 16
    tables = [FUSED.slot_table(s) for s in range(3)]
    assert np.array_equal(np.concatenate(tables), np.arange(9)) and tables[0].dtype == np.int32
    assert FUSED.scratch_table.tolist() == [9, 10, 10]
    with pytest.raises(ValueError, match="slot 3 has no fixed block table"):
        FUSED.slot_table(3)
    shared = GraphInputs(RUNTIME.model_copy(update={"num_blocks": 5}), KV, GROUP, fused_layers=True)
    assert shared.num_blocks == 7 and shared.scratch_table.tolist() == [5, 6, 6]
    assert shared.slot_table(0).tolist() == [0, 1, 2]
    with pytest.raises(ValueError, match="1 whole sequences in the pool of 5 blocks"):
        shared.slot_table(1)


def test_fused_prefill_chunk_writes_and_attends_through_its_table():
    table = np.array([7, 2, 9], np.int32)
    tokens, start = np.array([11, 12, 13, 14, 15]), 14  # positions 14..18 straddle blocks 0 and 1
    padded, positions, write, lengths, last, tables, row_table = FUSED.prefill(table, tokens, 8, start)
    assert list(padded[:5]) == [11, 12, 13, 14, 15] and not padded[5:].any()
    assert list(positions[:5]) == list(range(14, 19)) and last.tolist() == [4]
    want = [row(table, p, h) for p in range(14, 19) for h in range(KV)]  # row-major
    assert write[: 5 * KV].tolist() == want
    assert lengths.tolist() == [p + 1 for p in range(14, 19) for _ in range(KV)] + [0] * (3 * KV)
    assert tables.tolist() == [table.tolist()] and row_table.tolist() == [0] * 8


def test_mask_prefill_writes_head_major_and_pads_into_the_scratch_slot():
    table = np.array([5, 0, 8], np.int32)
    _, positions, write, mask, _, _, _ = MASK.prefill(table, np.arange(1, 18), 32)
    scratch = MASK.scratch_table
    want = [
        row(table, i, h) if i < 17 else row(scratch, i, h) for h in range(KV) for i in range(32)
    ]  # head-major
    assert write.tolist() == want and positions.tolist() == list(range(32))
    assert mask.shape == (GROUP * 32, 32) and mask[40, 7] == 0 and mask[40, 9] == -np.inf  # row 8


def test_decode_rows_follow_each_table_and_padding_uses_the_scratch_slot():
    tables = np.array([[4, 1, 6], [0, 10, 3]], np.int32)
    positions = np.array([17, 33])
    tokens, pos, write, got_tables, lengths, row_table = FUSED.decode(tables, [5, 6], positions, 4, 0)
    scratch = FUSED.scratch_table
    want = [row(t, p, h) for t, p in zip(tables, positions) for h in range(KV)]
    assert write.tolist() == want + [row(scratch, 0, h) for _ in range(2) for h in range(KV)]
    assert got_tables.tolist() == tables.tolist() + [scratch.tolist()] * 2
    assert lengths.tolist() == [18, 18, 34, 34, 0, 0, 0, 0] and row_table.tolist() == [0, 1, 2, 3]
    assert tokens.tolist() == [5, 6, 0, 0] and pos.tolist() == [17, 33, 0, 0]


def test_gather_decode_reads_the_rows_of_each_table():
    tables = np.array([[4, 1, 6]], np.int32)
    _, _, _, read, mask, _ = GATHER.decode(tables, [5], np.array([20]), 1, 40)
    assert read.shape == (KV, 40)
    assert read.tolist() == [[row(tables[0], p, h) for p in range(40)] for h in range(KV)]
    assert (mask[:, 0, :21] == 0).all() and (mask[:, 0, 21:] == -np.inf).all()


def test_kv_rows_are_head_major_positions_of_the_table():
    table = np.array([9, 3, 1], np.int32)
    assert FUSED.kv_rows(table, 20).tolist() == [row(table, p, h) for h in range(KV) for p in range(20)]


@pytest.mark.parametrize(
    "call, message",
    [
        (
            lambda: FUSED.prefill(np.array([0, 1, 12]), [1, 2], 8),
            "entry 12 is outside the pool of blocks 0..10",
        ),
        (lambda: FUSED.prefill(np.array([0, -1, 2]), [1, 2], 8), "entry -1 is outside the pool"),
        (lambda: FUSED.prefill(np.array([0, 1]), [1, 2], 8), r"shape \[n, 3\]"),
        (lambda: FUSED.prefill(np.array([0.0, 1.0, 2.0]), [1, 2], 8), "must be integers"),
        (lambda: FUSED.prefill(np.zeros((2, 3), int), [1, 2], 8), "one block table, got 2"),
        (lambda: FUSED.prefill(np.arange(3), [1] * 9, 8), "9 tokens does not fit its bucket of 8"),
        (lambda: FUSED.prefill(np.arange(3), [1, 2], 8, start=39), "positions up to 40"),
        (lambda: MASK.prefill(np.arange(3), [1, 2], 8, start=3), "after position 0 .* needs the fused"),
        (lambda: FUSED.decode(np.array([[0, 1, 2], [3, 4, 99]]), [1, 2], [3, 4], 4, 0), "entry 99"),
        (lambda: FUSED.decode(np.array([[0, 1, 2]]), [1], [40], 1, 0), "positions up to 40"),
        (lambda: FUSED.decode(np.zeros((3, 3), int), [1, 2, 3], [0, 1, 2], 1, 0), "3 tables.* in 1 rows"),
        (lambda: FUSED.kv_rows(np.array([0, 1, 12]), 4), "entry 12"),
        (lambda: FUSED.kv_rows(np.arange(3), 41), "positions up to 40"),
    ],
)
def test_bad_tables_and_positions_are_refused_on_the_host(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_block_size_larger_than_a_sequence_and_block_size_one():
    big = GraphInputs(RUNTIME.model_copy(update={"block_size": 64}), KV, GROUP, fused_layers=True)
    assert big.blocks_per_seq == 1 and big.num_blocks == 4
    assert big.kv_rows(np.array([2]), 3).tolist() == [row([2], p, h, 64) for h in range(KV) for p in range(3)]
    one = GraphInputs(RUNTIME.model_copy(update={"block_size": 1}), KV, GROUP, fused_layers=True)
    assert one.blocks_per_seq == 40 and one.num_blocks == 3 * 40 + 32  # 32 scratch blocks of 1
    table = np.arange(40)[::-1].astype(np.int32)
    assert one.kv_rows(table, 3).tolist() == [row(table, p, h, 1) for h in range(KV) for p in range(3)]


def test_sliding_window_layers_write_each_seat_s_ring_as_the_window_moves():
    """The ring's size (local_ring_blocks: the window and the largest bucket's positions, when shorter
    than a sequence), then rings of 2 blocks given by hand: slot s's table is blocks 2s, 2s + 1, 2s
    again..., so position 40 of slot 1 is written in block 2 over position 8's; padding rows take the
    scratch ring after the slots'."""
    from agent.graphs.interface import local_ring_blocks
    from agent.model.spec import ModelSpec

    long = RUNTIME.model_copy(update={"max_seq_len": 128, "attend_buckets": [16, 128]})
    spec = ModelSpec(
        architecture="gemma3", name="t", num_layers=6, hidden_size=64, num_heads=6, num_kv_heads=KV,
        head_dim=16, intermediate_size=64, vocab_size=10, rope_theta=1e6, rms_eps=1e-6,
        tied_embeddings=True, qkv_bias=False, max_context=128, bos_id=None, eos_ids=(),
        sliding_window=8, local_layers=(0, 1, 2, 3, 4),
    )  # fmt: skip
    assert local_ring_blocks(long, spec) == 3  # ceil((8 - 1 + 32) / 16) < 8 blocks a sequence
    assert local_ring_blocks(RUNTIME, spec) == 0  # 3 blocks: no shorter than a sequence of 40
    assert local_ring_blocks(long, spec.model_copy(update={"sliding_window": 0})) == 0
    rings = GraphInputs(long, KV, GROUP, fused_layers=True, ring_blocks=2)
    assert rings.local_cache_rows == (3 + 1) * 2 * KV * 16  # every slot's ring and the scratch one
    assert rings.ring_table(1).tolist() == [2, 3, 2, 3, 2, 3, 2, 3]
    assert rings.ring_table(None).tolist() == [6, 7] * 4
    table = FUSED.slot_table(2)
    padded = np.concatenate([table, rings.scratch_table[3:]])
    inputs = rings.prefill(padded, np.arange(5), 8, start=38, slot=1)
    assert len(inputs) == 9  # the seven of a fused prefill, then the local write rows and tables
    write_local, tables_local = inputs[7], inputs[8]
    assert tables_local.tolist() == [rings.ring_table(1).tolist()]
    ring = rings.ring_table(1)
    assert write_local.reshape(8, KV)[:5].tolist() == [
        [row(ring, p, h) for h in range(KV)] for p in range(38, 43)
    ]
    decode = rings.decode(np.stack([padded, padded]), np.array([1, 2]), np.array([40, 9]), 4, 0, slots=[1, 0])
    assert decode[-1].tolist() == [rings.ring_table(s).tolist() for s in (1, 0, None, None)]
    assert decode[-2].reshape(4, KV)[:2].tolist() == [
        [row(rings.ring_table(1), 40, h) for h in range(KV)],
        [row(rings.ring_table(0), 9, h) for h in range(KV)],
    ]
    assert len(FUSED.prefill(FUSED.slot_table(0), np.arange(5), 8)) == 7  # no rings: as before


def test_the_paged_backend_takes_upstreams_inputs_a_slot_per_row_and_lengths_per_sequence():
    """decode_attention paged, the inputs of MindSpore's Ascend kernels (agent/graphs/paged_attention.py):
    ReshapeAndCache's slot mapping (block table[p // B] * B + p % B, one per row, not per head);
    a table, batch_valid_length and q_seq_lens per sequence; each padding row a sequence of one row
    at position 0 of the scratch table, writing scratch position (its row). A prompt from position
    0 takes FlashAttentionScore's compressed causal mask; a chunk after cached positions a lookahead
    mask hiding each row's later positions; decode rows (one a sequence) a [1, 1] zero mask."""
    paged = GraphInputs(
        RUNTIME.model_copy(update={"decode_attention": "paged"}), KV, GROUP, fused_layers=True
    )
    table = np.array([7, 2, 5], np.int32)
    scratch = paged.scratch_table
    tokens, positions, slots, valid, q_lens, tables, mask, logit_rows = paged.prefill(
        table, np.arange(3), 8, start=15
    )
    assert tokens.tolist() == [0, 1, 2, 0, 0, 0, 0, 0] and positions.tolist() == [15, 16, 17, 0, 0, 0, 0, 0]
    assert slots.tolist()[:3] == [7 * 16 + 15, 2 * 16 + 0, 2 * 16 + 1]
    assert slots.tolist()[3:] == [int(scratch[p // 16]) * 16 + p % 16 for p in range(3, 8)]
    assert valid.tolist() == [18, 1, 1, 1, 1, 1] and q_lens.tolist() == [3, 1, 1, 1, 1, 1]
    assert tables.tolist() == [table.tolist()] + [scratch.tolist()] * 5 and logit_rows.tolist() == [2]
    assert mask.shape == (8, 48) and (mask[1, :17] == 0).all() and (mask[1, 17:] == MASK_VALUE).all()
    *_, mask, logit_rows = paged.prefill(table, np.arange(3), 8, start=0, every_row=True)
    assert mask.tolist() == prompt_mask("float32").tolist() and logit_rows.tolist() == list(range(8))
    assert paged.attend(np.array([30])) == 0  # one decode graph per batch: no attend buckets
    _, positions, slots, valid, q_lens, tables, mask, _ = paged.decode(
        table[None], np.array([4]), np.array([33]), 4, 0
    )
    assert slots[0] == 5 * 16 + 1 and valid.tolist() == [34, 1, 1, 1] and q_lens.tolist() == [1] * 4
    # padding rows write scratch positions 1..3 (their rows), not all of them position 0
    assert slots.tolist()[1:] == [int(scratch[0]) * 16 + p for p in (1, 2, 3)]
    assert tables.shape == (4, 3) and mask.tolist() == [[0.0]] and positions.tolist() == [33, 0, 0, 0]
    cpu_slots, cpu_lengths = FUSED.paging(np.array([[row(table, 33, 0), row(table, 33, 1)]]), np.array([34]))
    assert cpu_slots.tolist() == [row(table, 33, 0), row(table, 33, 1)] and cpu_lengths.tolist() == [34, 34]
