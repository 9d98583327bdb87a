"""GraphInputs: host-side values (block tables, token ids, positions) as a graph set's prefill, decode
and mixed-step inputs, every index checked (the cache layout: agent/graphs/interface.py). NumPy only."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import NamedTuple

import numpy as np

from agent.contract.step import StepChunk
from agent.graphs.shapes import bucket, decode_attends, pool_blocks, scratch_blocks
from config.schema import RuntimeSection

# The masks' value for a hidden position (vllm-mindspore's: the internal kernels add it to the scores
# in float16 and bfloat16 alike for PagedAttention; FlashAttentionScore's compressed bfloat16 mask
# holds 1 where float16's holds it)
MASK_VALUE = -10000.0
PROMPT_MASK_SIZE = 128  # the compressed causal mask FlashAttentionScore's internal kernel tiles


class StateMove(NamedTuple):
    """What a call does with a sequence's Gated DeltaNet state besides running its rows
    (agent/kernels/gated_delta.h): replay the rows of its last held run that were kept, hold this
    run's rows (run them on a copy, kept for a replay: proposals being verified), restore the state
    from a snapshot slot first, save it into one after (-1: neither)."""

    replay: int = 0
    hold: bool = False
    restore: int = -1
    save: int = -1


NO_MOVE = StateMove()
StateMoves = Mapping[int, StateMove]  # by slot


def prompt_mask(dtype: str) -> np.ndarray:
    """FlashAttentionScore's compressed causal mask, [128, 128], for a model in `dtype`."""
    value = 1.0 if dtype == "bfloat16" else MASK_VALUE
    return np.triu(np.ones((PROMPT_MASK_SIZE, PROMPT_MASK_SIZE), np.float32), 1) * value


class GraphInputs:
    """Host-side inputs of one graph set's prefill and decode graphs, as NumPy arrays in graph order,
    from block tables (int arrays of MB block ids, position p in block table[p // B]).

    Prefill: tokens, positions, write rows, the mask [G*S, S] (or, with fused layers, the kernel's
    row-major write rows and lengths [S*KV]), the last real token's index, the block table [1, MB]
    and each row's table row [S] (zeros). Decode: tokens, positions, write rows [B*KV], then with
    the attention kernel the block tables [B, MB] and each (row, head)'s length [B*KV], else the rows
    it attends [B*KV, attend] and their mask [B*KV, 1, attend]; then each row's table row [B]
    (0..B-1). Indices are checked here: a table entry outside the pool, a position beyond a table
    or the rope tables is a ValueError."""

    def __init__(
        self,
        runtime: RuntimeSection,
        kv_heads: int,
        group: int,
        fused_layers: bool,
        ring_blocks: int = 0,
        state_slots: bool = False,
    ):
        """kv_heads: this rank's; fused_layers: each layer is one kernel (or the paged backend),
        which takes write rows and lengths in place of the prefill mask (paging), and reads earlier
        positions from the cache (a prompt chunk may start after position 0); ring_blocks: each
        slot's ring in the sliding-window layers (local_ring_blocks), whose write rows and tables
        then follow each call's inputs (`slots`: each sequence's slot); state_slots: the model has
        Gated DeltaNet layers, whose state slot of each table follows them (a sequence's slot, the
        scratch one num_slots for padding)."""
        self.num_slots, self.max_len = runtime.planned_num_slots, runtime.planned_max_seq_len
        self.max_seqs = runtime.decode_batch_buckets[-1]  # sequences of one mixed step
        self.block_size = runtime.block_size
        self.blocks_per_seq = -(-self.max_len // self.block_size)  # MB: a table's length
        self.num_blocks = pool_blocks(runtime)  # the pool, the scratch blocks included
        self.pool = runtime.planned_num_blocks  # the blocks a server hands out
        self.kv_heads, self.group, self.fused_layers = kv_heads, group, fused_layers
        # the paged backend's inputs: slots per row, lengths and tables per sequence (paged_attention.py)
        self.paged = runtime.paged_attention
        self.dtype = runtime.dtype
        self.decode_attends = decode_attends(runtime)
        self._head_rows = np.arange(kv_heads, dtype=np.int64)
        self.scratch_positions = scratch_blocks(runtime) * self.block_size
        scratch = self.pool + np.minimum(np.arange(self.blocks_per_seq), scratch_blocks(runtime) - 1)
        self.scratch_table = scratch.astype(np.int32)
        self.ring = ring_blocks
        self.state_slots = state_slots
        # each slot's ring table (the scratch ring last): fixed by the slot, built once
        self._ring_tables = None
        if ring_blocks:
            ring_slots, blocks = np.arange(self.num_slots + 1)[:, None], np.arange(self.blocks_per_seq)
            self._ring_tables = (ring_slots * ring_blocks + blocks % ring_blocks).astype(np.int32)

    @property
    def local_cache_rows(self) -> int:
        """Rows of each sliding-window layer's K (and V) cache: every slot's ring and the scratch one."""
        return (self.num_slots + 1) * self.ring * self.kv_heads * self.block_size

    def ring_table(self, slot: int | None) -> np.ndarray:
        """The sliding-window layers' table [MB] of a slot (None: the scratch ring)."""
        slot = self.num_slots if slot is None else int(slot)
        if not 0 <= slot <= self.num_slots:
            raise ValueError(f"slot {slot} is out of range 0..{self.num_slots - 1}")
        assert self._ring_tables is not None, "no sliding-window rings"
        return self._ring_tables[slot].copy()

    def _local(self, slots: Sequence[int | None], row_table: np.ndarray, positions: np.ndarray) -> tuple:
        """The sliding-window layers' write rows [rows * KV] (row-major) and tables [len(slots), MB]:
        table row t is slot slots[t]'s ring (None: the scratch ring), row i at positions[i] writes
        through table row row_table[i]; () without rings."""
        if self._ring_tables is None:
            return ()
        rings = np.array([self.num_slots if s is None else int(s) for s in slots], np.int64)
        if rings.size and not 0 <= rings.min() <= rings.max() <= self.num_slots:
            raise ValueError(f"slots {list(rings)} are out of range 0..{self.num_slots - 1}")
        tables = self._ring_tables[rings]
        write = self.rows(tables[row_table], np.asarray(positions, np.int64)[:, None])[:, 0]
        return write.reshape(-1).astype(np.int32), tables

    def _states(self, slots: Sequence[int | None], moves: StateMoves) -> tuple:
        """Each table's state slot and StateMove [len(slots), 5] (fused_layer.cc input 13; None: the
        scratch slot num_slots, which moves nothing), () without Gated DeltaNet layers."""
        if not self.state_slots:
            return ()
        rows = [
            (self.num_slots, *NO_MOVE) if s is None else (int(s), *moves.get(int(s), NO_MOVE)) for s in slots
        ]
        states = np.array(rows, np.int32).reshape(len(rows), 5)
        if states.size and not 0 <= states[:, 0].min() <= states[:, 0].max() <= self.num_slots:
            raise ValueError(f"slots {list(states[:, 0])} are out of range 0..{self.num_slots - 1}")
        return (states,)

    def extra(
        self,
        slots: Sequence[int | None],
        row_table: np.ndarray,
        positions: np.ndarray,
        moves: StateMoves | None = None,
    ) -> tuple:
        """What follows a fused call's inputs (the stack's `extra`): the sliding-window layers' write
        rows and tables, then the tables' state slots and moves (by slot), each where the model has
        them."""
        return (*self._local(slots, row_table, positions), *self._states(slots, moves or {}))

    @property
    def cache_rows(self) -> int:
        """Rows of each layer's K (and V) cache."""
        return self.num_blocks * self.kv_heads * self.block_size

    def slot_table(self, slot: int) -> np.ndarray:
        """The fixed block table [MB] int32 of `slot`, where the pool holds every slot's whole
        length (tools and tests; a server sends tables)."""
        mb = self.blocks_per_seq
        if not 0 <= slot < self.num_slots or (slot + 1) * mb > self.pool:
            raise ValueError(
                f"slot {slot} has no fixed block table (slots 0..{self.num_slots - 1}, "
                f"{self.pool // mb} whole sequences in the pool of {self.pool} blocks): send a table"
            )
        return np.arange(slot * mb, (slot + 1) * mb, dtype=np.int32)

    def table(self, given: Sequence[int] | np.ndarray, positions: int) -> np.ndarray:
        """A server's block table of a sequence of `positions` positions, checked and padded to MB
        with scratch blocks: the blocks that hold those positions lie in the pool the server hands
        out; entries after them may be -1 (the server pads the tables of one call to the longest)."""
        table = np.asarray(given)
        mb, size = self.blocks_per_seq, self.block_size
        if table.ndim != 1 or len(table) > mb or table.dtype.kind not in "iu":
            raise ValueError(
                f"a block table lists at most {mb} integer blocks, got {table.dtype}{list(table.shape)}"
            )
        used = -(-positions // size)
        if len(table) < used:
            raise ValueError(
                f"a block table of {len(table)} blocks of {size} does not cover {positions} positions"
            )
        held, rest = table[:used], table[used:]
        if ((held < 0) | (held >= self.pool)).any() or ((rest < -1) | (rest >= self.pool)).any():
            raise ValueError(
                f"block table entries lie in 0..{self.pool - 1} (then -1 past the sequence's blocks)"
            )
        padded = self.scratch_table.copy()
        padded[: len(table)] = np.where(table >= 0, table, padded[: len(table)])
        return padded

    def attend(self, positions: np.ndarray) -> int:
        """The decode graph's attended length for rows writing at `positions` (0: each row's own)."""
        return 0 if self.decode_attends == [0] else bucket(self.decode_attends, int(positions.max()) + 1)

    def paging(self, write: np.ndarray, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Write rows [rows, KV] and attended lengths [rows] as the CPU kernels take them: row-major
        cache rows and lengths [rows * KV] (they skip padding rows, of length 0)."""
        return write.reshape(-1).astype(np.int32), np.repeat(lengths, self.kv_heads).astype(np.int32)

    def paged_step(
        self,
        sequences: Sequence[tuple[np.ndarray, np.ndarray, int]],
        rows: int,
        logit_rows: Sequence[int] | np.ndarray,
        prompt: bool,
    ) -> tuple[np.ndarray, ...]:
        """The paged graphs' inputs (agent/graphs/paged_attention.py) for `sequences` (a checked
        block table [MB], the new tokens, the position of the first) padded to `rows`: input_ids,
        positions, slot_mapping, batch_valid_length, q_seq_lens, block_tables, attn_mask and the
        rows whose logits the graph returns. prompt: for the prefill phase's graph (every sequence
        from position 0), whose mask is FlashAttentionScore's compressed one. Each padding row is
        a sequence of one row of its own in the scratch blocks, at position 0, writing scratch
        position (its row), past every position a real row of the call writes there (warm-up's
        probe: scratch positions 0..n-1)."""
        sizes = [len(tokens) for _, tokens, _ in sequences]
        pad = rows - sum(sizes)
        if pad < 0 or min(sizes, default=1) < 1:
            raise ValueError(f"sequences of {sizes} new tokens do not fit {rows} rows")
        each = [start + np.arange(n) for (_, _, start), n in zip(sequences, sizes)]
        real = np.concatenate(each) if each else np.zeros(0, np.int64)
        self.check_positions(real, "the step")
        size = self.block_size
        blocks = [table[p // size] for (table, _, _), p in zip(sequences, each)]
        at = np.arange(sum(sizes), rows) % self.scratch_positions
        slots = [
            *(b * size + p % size for b, p in zip(blocks, each)),
            self.scratch_table[at // size] * size + at % size,
        ]
        if prompt and any(start for _, _, start in sequences):
            raise ValueError("a prompt step's sequences start at position 0")
        positions = np.concatenate([real, np.zeros(pad, np.int64)])
        if prompt:
            mask = prompt_mask(self.dtype)
        elif max(sizes, default=1) == 1:
            mask = np.zeros((1, 1), np.float32)  # one row a sequence: nothing to hide
        else:  # a row hides the positions after its own (the later rows of its sequence)
            width = self.blocks_per_seq * size
            mask = np.where(np.arange(width)[None, :] > positions[:, None], MASK_VALUE, 0.0)
        tokens = [*(np.asarray(t, np.int64) for _, t, _ in sequences), np.zeros(pad, np.int64)]
        return (
            np.concatenate(tokens).astype(np.int32),
            positions.astype(np.int32),
            np.concatenate(slots).astype(np.int32),
            np.array([start + n for (_, _, start), n in zip(sequences, sizes)] + [1] * pad, np.int32),
            np.array(sizes + [1] * pad, np.int32),
            np.stack([table for table, _, _ in sequences] + [self.scratch_table] * pad).astype(np.int32),
            mask.astype(np.float32),
            np.asarray(logit_rows, np.int32),
        )

    def rows(self, tables: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """Cache rows [n, P, KV] of `positions` [n, P] of the sequences with block `tables` [n, MB]
        (unchecked: check_tables and check_positions first)."""
        positions = np.asarray(positions, np.int64)
        blocks = np.take_along_axis(np.asarray(tables, np.int64), positions // self.block_size, axis=1)
        offsets = positions % self.block_size
        return (blocks[..., None] * self.kv_heads + self._head_rows) * self.block_size + offsets[..., None]

    def kv_rows(self, table: np.ndarray, length: int) -> np.ndarray:
        """Cache rows of positions 0..length-1 of the sequence with block `table`, head-major
        [KV * length] int32 (the order of a K/V transfer); the paged backend's (block, offset) of
        each position [length, 2]."""
        tables = self.check_tables(table)
        positions = np.arange(length)[None, :]
        self.check_positions(positions, "a KV transfer")
        if self.paged:
            blocks = tables[0, positions[0] // self.block_size]
            return np.stack([blocks, positions[0] % self.block_size], 1).astype(np.int32)
        return self.rows(tables[:1], positions)[0].T.reshape(-1).astype(np.int32)

    def check_tables(self, tables: np.ndarray) -> np.ndarray:
        """`tables` ([MB] or [n, MB]) as int32 [n, MB], each entry a block of the pool."""
        tables = np.asarray(tables)
        if tables.ndim == 1:
            tables = tables[None, :]
        mb = self.blocks_per_seq
        if tables.ndim != 2 or tables.shape[1] != mb or not np.issubdtype(tables.dtype, np.integer):
            raise ValueError(
                f"block tables must be integers of shape [n, {mb}] ({mb} blocks of {self.block_size} "
                f"positions each), got {tables.dtype}{list(tables.shape)}"
            )
        if tables.size and (tables.min() < 0 or tables.max() >= self.num_blocks):
            bad = tables[(tables < 0) | (tables >= self.num_blocks)][0]
            raise ValueError(
                f"block table entry {bad} is outside the pool of blocks 0..{self.num_blocks - 1}"
            )
        return tables.astype(np.int32)

    def check_positions(self, positions: np.ndarray, what: str) -> None:
        """Positions within a table's blocks and the rope tables (max_seq_len)."""
        positions = np.asarray(positions)
        if positions.size and (positions.min() < 0 or positions.max() >= self.max_len):
            raise ValueError(
                f"{what} writes positions up to {int(positions.max())}: positions lie in "
                f"0..{self.max_len - 1} (max_seq_len {self.max_len})"
            )

    def prefill(
        self,
        table: np.ndarray,
        tokens: np.ndarray,
        length: int,
        start: int = 0,
        slot: int | None = None,
        every_row: bool = False,
        moves: StateMoves | None = None,
    ) -> tuple[np.ndarray, ...]:
        """Prompt `tokens` padded to `length`, at positions start..start+n-1 of the sequence with block
        `table`; positions 0..start-1 must already be in the cache (chunked prefill, prefix hits).
        Padding rows write to the scratch slot (the mask path) or nowhere (fused layers). `slot`:
        the sequence's slot (its ring in sliding-window layers; None: the scratch ring); `moves`:
        its StateMove (Gated DeltaNet layers)."""
        n = len(tokens)
        tables = self.check_tables(table)
        if tables.shape[0] != 1:
            raise ValueError(f"a prefill takes one block table, got {tables.shape[0]}")
        if not 1 <= n <= length:
            raise ValueError(f"a prefill of {n} tokens does not fit its bucket of {length}")
        if start < 0:
            raise ValueError(f"a prefill starts at a position >= 0, not {start}")
        if start > 0 and not self.fused_layers:
            raise ValueError(
                "a prefill after position 0 (a chunk after cached positions) needs the fused layers "
                "(runtime.decode_attention and runtime.matmul: kernel, no tensor parallelism); these "
                "graphs attend within the prompt only"
            )
        index = np.arange(length)
        real = index < n
        positions = np.where(real, start + index, index)  # padding: the scratch slot's positions
        self.check_positions(positions[real], "the prefill")
        self.check_positions(positions, "the prefill's padding")
        padded = np.zeros(length, np.int32)
        padded[:n] = tokens
        write = np.where(
            real[:, None],
            self.rows(tables, (positions * real)[None, :])[0],
            self.rows(self.scratch_table[None, :], index[None, :])[0],
        )  # [S, KV]
        # the rows whose logits it returns: the last real one, or (prompt logprobs) all, a shape per
        # bucket (one more compile of the graph per bucket, only where asked)
        last = np.arange(length, dtype=np.int32) if every_row else np.array([n - 1], np.int32)
        if self.paged:
            return self.paged_step([(tables[0], np.asarray(tokens), start)], length, last, prompt=start == 0)
        paging = (tables, np.zeros(length, np.int32))
        if self.fused_layers:  # row-major write rows, and lengths in place of the mask
            lengths = np.where(real, positions + 1, 0)
            return (
                padded,
                positions.astype(np.int32),
                *self.paging(write, lengths),
                last,
                *paging,
                *self.extra([slot], paging[1], positions, moves),
            )
        causal = np.where(index[None, :] > index[:, None], -np.inf, 0.0).astype(np.float32)
        mask = np.tile(causal, (self.group, 1))  # [G*S, S], query rows grouped per head
        return padded, positions.astype(np.int32), write.T.reshape(-1).astype(np.int32), mask, last, *paging

    def mixed(
        self,
        decode_tables: np.ndarray,
        decode_tokens: np.ndarray,
        decode_positions: np.ndarray,
        chunks: Sequence[StepChunk],
        rows: int,
        logit_rows: int,
        decode_slots: Sequence[int] | None = None,
        moves: StateMoves | None = None,
    ) -> tuple[np.ndarray, ...]:
        """A mixed step as the prefill graph's inputs (fused layers only): the decode rows (one token at
        `decode_positions` of each of the sequences with `decode_tables` [d, MB]), then each chunk's
        rows (its new tokens at positions start.. of its table), then
        padding to `rows`; tables [max_seqs, MB] (the decode rows', then the chunks', then scratch),
        each row's table row, and the logit rows: each decode row, then every row of a scored chunk
        and the last row of each chunk that samples, then row 0 to `logit_rows` (a chunk that does
        not end its prompt needs none: 16 streams beside one such chunk take the 16-row LM head,
        not the 32-row one). `moves`: the slots' StateMoves (Gated DeltaNet layers)."""
        if not self.fused_layers:
            raise ValueError("a mixed step needs the fused layers")
        decode_tables = self.check_tables(decode_tables) if len(decode_tables) else np.zeros((0, 0), np.int32)
        decode_positions = np.asarray(decode_positions, np.int64)
        d = len(decode_tokens)
        if not len(decode_tables) == d == len(decode_positions):
            raise ValueError(f"a mixed step of {d} decode tokens got {len(decode_tables)} tables")
        sizes = [len(c.new_tokens) for c in chunks]
        sampled = d + sum(size if c.scored else c.sample for c, size in zip(chunks, sizes))
        if (
            d + sum(sizes) > rows
            or d + len(chunks) > self.max_seqs
            or sampled > logit_rows
            or min(sizes, default=1) < 1
        ):
            raise ValueError(
                f"a mixed step of {d} decode rows and chunks of {sizes} tokens ({sampled} sampling) does "
                f"not fit {rows} rows, {self.max_seqs} sequences and {logit_rows} logit rows"
            )
        tables = [decode_tables] if d else []
        tokens, positions, table_of = (
            [np.asarray(decode_tokens, np.int64)],
            [decode_positions],
            [np.arange(d)],
        )
        last = list(range(d))
        for i, chunk in enumerate(chunks):
            if chunk.start < 0:
                raise ValueError(f"a chunk starts at a position >= 0, not {chunk.start}")
            tables.append(self.check_tables(np.asarray(chunk.table)))
            tokens.append(np.asarray(chunk.new_tokens, np.int64))
            positions.append(chunk.start + np.arange(sizes[i]))
            table_of.append(np.full(sizes[i], d + i))
            first = d + sum(sizes[:i])
            if chunk.scored:  # a decoding slot's rows and its proposals: every row's logits
                last.extend(range(first, first + sizes[i]))
            elif chunk.sample:
                last.append(first + sizes[i] - 1)
        if self.paged:
            decoding = [
                (t, np.asarray(decode_tokens[i : i + 1]), int(p))
                for i, (t, p) in enumerate(zip(decode_tables, decode_positions))
            ]
            chunked = [(t[0], tok, c.start) for t, tok, c in zip(tables[1 if d else 0 :], tokens[1:], chunks)]
            return self.paged_step(
                decoding + chunked, rows, last + [0] * (logit_rows - len(last)), prompt=False
            )
        pad = rows - d - sum(sizes)
        tables.append(np.repeat(self.scratch_table[None, :], self.max_seqs - d - len(chunks), 0))
        all_tables = np.concatenate(tables).astype(np.int32)
        real_positions = np.concatenate(positions)
        self.check_positions(real_positions, "the mixed step")
        row_table = np.concatenate([*table_of, np.zeros(pad, np.int64)]).astype(np.int32)
        positions_all = np.concatenate([real_positions, np.zeros(pad, np.int64)])
        real = np.arange(rows) < rows - pad
        write = np.where(
            real[:, None],
            self.rows(all_tables[row_table], positions_all[:, None])[:, 0],
            self.rows(self.scratch_table[None, :], np.zeros((1, 1), np.int64))[0, 0][None, :],
        )  # [rows, KV]; padding rows write nothing (the kernel skips them)
        lengths = np.where(real, positions_all + 1, 0)
        row_slots = [*(decode_slots if decode_slots is not None else [None] * d), *(c.slot for c in chunks)]
        return (
            np.concatenate([*tokens, np.zeros(pad, np.int64)]).astype(np.int32),
            positions_all.astype(np.int32),
            *self.paging(write, lengths),
            np.array(last + [0] * (logit_rows - len(last)), np.int32),
            all_tables,
            row_table,
            *self.extra(
                row_slots + [None] * (len(all_tables) - len(row_slots)), row_table, positions_all, moves
            ),
        )

    def decode(
        self,
        tables: np.ndarray,
        tokens: np.ndarray,
        positions: np.ndarray,
        rows: int,
        attend: int,
        slots: Sequence[int] | None = None,
        moves: StateMoves | None = None,
    ) -> tuple[np.ndarray, ...]:
        """Tokens at `positions` of the sequences with block `tables` [n, MB], padded to `rows`
        (padding rows write to the scratch slot and attend nothing); `attend`: the gather path's
        bucket, ignored by the kernel; `slots`: the sequences' slots (their rings in sliding-window
        layers; None: the scratch ring); `moves`: their StateMoves (Gated DeltaNet layers)."""
        tables = self.check_tables(tables)
        positions = np.asarray(positions, np.int64)
        if not len(tables) == len(tokens) == len(positions) <= rows:
            raise ValueError(
                f"decode of {len(tables)} tables, {len(tokens)} tokens, {len(positions)} positions in "
                f"{rows} rows"
            )
        self.check_positions(positions, "the decode step")
        if self.paged:
            decoding = [
                (t, np.asarray(tokens[i : i + 1]), int(p)) for i, (t, p) in enumerate(zip(tables, positions))
            ]
            return self.paged_step(decoding, rows, np.arange(rows), prompt=False)
        pad = rows - len(tables)
        lengths = np.concatenate([positions + 1, np.zeros(pad, np.int64)])  # padding attends nothing
        tables = np.concatenate([tables, np.repeat(self.scratch_table[None, :], pad, 0)])
        tokens = np.concatenate([tokens, np.zeros(pad, np.int64)]).astype(np.int32)
        positions = np.concatenate([positions, np.zeros(pad, np.int64)])
        write = self.rows(tables, positions[:, None])[:, 0]  # [rows, KV]
        row_table = np.arange(rows, dtype=np.int32)
        if self.decode_attends == [0]:  # each row's own length; the fused layer skips padding rows
            row_slots = [*(slots if slots is not None else [None] * (rows - pad)), *[None] * pad]
            write_rows, row_lengths = self.paging(write, lengths)
            return (
                tokens,
                positions.astype(np.int32),
                write_rows,
                tables,
                row_lengths,
                row_table,
                *self.extra(row_slots, row_table, positions, moves),
            )
        if attend > self.max_len:
            raise ValueError(f"attend bucket {attend} exceeds max_seq_len {self.max_len}")
        read = self.rows(tables, np.tile(np.arange(attend), (rows, 1))).transpose(0, 2, 1)  # [rows, KV, A]
        visible = np.arange(attend)[None, :] <= positions[:, None]  # [rows, attend]
        mask = np.where(visible, 0.0, -np.inf).astype(np.float32).repeat(self.kv_heads, axis=0)
        return (
            tokens,
            positions.astype(np.int32),
            write.reshape(-1).astype(np.int32),
            read.reshape(rows * self.kv_heads, attend).astype(np.int32),
            mask[:, None, :],
            row_table,
        )
