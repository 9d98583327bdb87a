"""StepChecks: a runner's limits (what one call may hold, from the runtime and the graphs) and the
checks of each call against them and its slots, which change nothing; ModelRunner (agent/runner.py)
holds one and runs only what they let through, so a refused call leaves every slot as it was."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from agent.contract.step import MAX_DRAFT_TOKENS, BlockTable, StepChunk, StepLimits
from agent.graphs.interface import MixedStepGraphs, ModelGraphs, mixed_rows
from agent.graphs.shapes import held_rows
from agent.slots import RunnerError, SlotState, SlotTable
from agent.token_chooser import TokenChooser
from config.schema import RuntimeSection


class StepChecks:
    def __init__(self, graphs: ModelGraphs, runtime: RuntimeSection, slots: SlotTable, chooser: TokenChooser):
        """The checks of calls over `graphs` built for `runtime`, of the slots of `slots`; `chooser`
        checks the token masks."""
        self.graphs = graphs
        self.spec = graphs.spec
        self.runtime = runtime
        self.slot_table = slots
        self.chooser = chooser
        self.max_len = runtime.planned_max_seq_len
        # Rows of one mixed step (decode rows and prompt chunks in one graph call), 0 where these
        # graphs run none: fixed by the graphs, and read several times a step (an isinstance of a
        # Protocol walks its members: 0.2 ms a step).
        fused = isinstance(graphs, MixedStepGraphs) and graphs.inputs.fused_layers
        self.mixed_rows = mixed_rows(runtime) if fused else 0

    @property
    def num_blocks(self) -> int:
        """The pool's blocks a server may hand out: 0..num_blocks-1 (the scratch blocks follow)."""
        return self.graphs.inputs.pool

    @property
    def max_chunk(self) -> int:
        """The most prompt positions one prefill graph call computes (a longer chunk is split)."""
        return self.runtime.prefill_buckets[-1]

    @property
    def chunked_prefill(self) -> bool:
        """Whether a prefill may start after cached positions (chunks, prefix-cache hits): not in an
        encoder, whose every position attends the whole prompt (ModelSpec.bidirectional)."""
        return self.graphs.inputs.fused_layers and not self.spec.bidirectional

    @property
    def prefix_caching(self) -> bool:
        """Whether a prompt may start from another sequence's blocks (a prefix-cache hit): not where
        sliding-window layers keep their KV in each slot's ring (agent/graphs/interface.py), nor
        where Gated DeltaNet layers keep no snapshots of their states (a hit resumes from one)."""
        hybrid = self.spec.linear_attention is not None
        return (
            self.chunked_prefill
            and not self.graphs.inputs.ring
            and (not hybrid or self.runtime.state_snapshots > 0)
        )

    @property
    def max_proposals(self) -> int:
        """The most tokens proposed for one slot a step verifies (0: none): a mixed step's; with Gated
        DeltaNet layers, as many as their states hold rows for beside the pending token
        (runtime.speculation's num_tokens)."""
        if not self.mixed_rows:
            return 0
        return held_rows(self.runtime) - 1 if self.spec.linear_attention is not None else MAX_DRAFT_TOKENS

    @property
    def max_prompt_len(self) -> int:
        """The longest prompt: one position stays for an answer; without chunks, one graph call."""
        return self.max_len - 1 if self.chunked_prefill else min(self.max_len - 1, self.max_chunk)

    def chunk(self, chunk: StepChunk) -> tuple[np.ndarray, np.ndarray]:
        """A chunk's checks (nothing changes): its token ids and its table padded to MB blocks."""
        slot, tokens, table, start, sample = chunk.slot, chunk.tokens, chunk.table, chunk.start, chunk.sample
        self.slot_table.check_slot(slot)
        ids = self.tokens(tokens)
        end = len(ids)
        if end > self.max_prompt_len and (sample or not self.chunked_prefill):
            raise RunnerError(
                f"prompt of {end} tokens exceeds the longest prompt this agent accepts "
                f"({self.max_prompt_len} tokens)"
            )
        if end >= self.max_len:
            raise RunnerError(f"{end} positions do not fit max_seq_len {self.max_len}")
        state = self.slot_table.slots.get(slot)
        if state is not None and sample and state.sampler is not None:
            raise RunnerError(f"slot {slot} has sampled already; release it first")
        # A free slot may start anywhere (a prefix-cache hit); an occupied one not past what it holds.
        if not 0 <= start < end or (state is not None and start > state.length):
            raise RunnerError(
                f"a prefill computes positions start..{end - 1} after the "
                f"{0 if state is None else state.length} the slot holds, not from {start}"
            )
        self._state_moves(chunk, state)
        return ids, self.padded_table(slot, table, end)

    def _state_moves(self, chunk: StepChunk, state: SlotState | None) -> None:
        """A chunk's Gated DeltaNet state moves: snapshots in range; a chunk after position 0 goes
        on from the state its slot holds, or from the snapshot it restores (a prefix-cache hit's)."""
        restore, save = chunk.restore, chunk.save
        if self.spec.linear_attention is None:
            if restore is not None or save is not None:
                raise RunnerError("this model has no Gated DeltaNet states to restore or save")
            return
        snapshots = self.runtime.state_snapshots
        for name, value in (("restore", restore), ("save", save)):
            if value is not None and not 0 <= value < snapshots:
                raise RunnerError(f"a chunk's {name} snapshot {value} is outside 0..{snapshots - 1}")
        held = 0 if state is None else state.length
        if restore is not None and chunk.start == 0:
            raise RunnerError("a chunk from position 0 restores no state")
        if restore is None and 0 < chunk.start != held:
            raise RunnerError(
                f"slot {chunk.slot}'s state holds {held} positions: a chunk from position {chunk.start} "
                "restores a snapshot's"
            )

    def decode(
        self,
        slots: Sequence[int],
        tables: Sequence[BlockTable] | None,
        drafts: Mapping[int, Sequence[int]] | None = None,
    ) -> tuple[list[SlotState], list[np.ndarray]]:
        """A decode step's checks (nothing changes): each slot's state and its padded table, which
        covers its next position and those of its proposals (`drafts`)."""
        drafts = drafts or {}
        if len(set(slots)) != len(slots):
            raise RunnerError(f"decode slots repeat: {list(slots)}")
        if tables is not None and len(tables) != len(slots):
            raise RunnerError(f"decode of {len(slots)} slots got {len(tables)} block tables")
        states = [self.slot_table.active(s) for s in slots]
        for slot, state in zip(slots, states):
            if state.length + len(drafts.get(slot, ())) >= self.max_len:
                raise RunnerError(f"slot {slot} is full ({self.max_len} positions)")
            if state.sampler is None or state.next_token is None:
                raise RunnerError(f"slot {slot} has not finished its prompt")
            if state.sampler.fault is not None:
                raise RunnerError(
                    f"slot {slot} ended with an error ({state.sampler.fault.message}); release it"
                )
        if tables is None:
            return states, [s.table for s in states]
        return states, [
            self.padded_table(slot, t, s.length + 1 + len(drafts.get(slot, ())))
            for slot, s, t in zip(slots, states, tables)
        ]

    @property
    def limits(self) -> StepLimits:
        """What one mixed step holds (the scheduler plans by the same rule)."""
        return StepLimits(self.mixed_rows, self.runtime.decode_batch_buckets[-1])

    def mixed(
        self,
        slots: Sequence[int],
        tables: Sequence[BlockTable] | None,
        chunks: Sequence[StepChunk],
        masks: Mapping[int, np.ndarray],
        drafts: Mapping[int, Sequence[int]],
    ) -> tuple[list[SlotState], list[np.ndarray], list[tuple[np.ndarray, np.ndarray]]]:
        """A mixed step's checks (nothing changes): the decode slots' states and padded tables, and
        each chunk's token ids and padded table."""
        if not self.mixed_rows:
            raise RunnerError("these graphs run no mixed steps (fused layers, graphs built here)")
        if not chunks and not drafts:
            raise RunnerError("a mixed step needs prompt chunks or proposals")
        chunk_slots = [c.slot for c in chunks]
        if len(set(chunk_slots)) != len(chunk_slots) or set(chunk_slots) & set(slots):
            raise RunnerError(f"a mixed step names a slot twice: decode {list(slots)}, chunks {chunk_slots}")
        self._drafts(drafts, slots, masks)
        states, padded = self.decode(slots, tables, drafts)
        checked = [self.chunk(c) for c in chunks]
        if masks:
            self.chooser.check_masks(masks, [*slots, *(c.slot for c in chunks if c.sample)])
        proposed = sum(len(p) for p in drafts.values())
        chunk_rows = [len(ids) - c.start for c, (ids, _) in zip(chunks, checked)]
        refusal = self.limits.refusal(len(slots), proposed, chunk_rows, sum(c.sample for c in chunks))
        if refusal is not None:
            raise RunnerError(refusal)
        return states, padded, checked

    def _drafts(
        self, drafts: Mapping[int, Sequence[int]], slots: Sequence[int], masks: Mapping[int, np.ndarray]
    ) -> None:
        """Proposals for decode slots of this call, at most max_proposals token ids each, and none
        for a slot whose next token is masked (a grammar's mask holds for one token only)."""
        most = self.max_proposals
        for slot, proposed in drafts.items():
            if slot not in slots:
                raise RunnerError(f"proposals for slot {slot}, which this step does not decode")
            if slot in masks:
                raise RunnerError(f"slot {slot} has a token mask: its next token cannot be proposed")
            if not 1 <= len(proposed) <= most:
                raise RunnerError(f"a slot's proposals are 1..{most} tokens, got {len(proposed)}")
            self.tokens(proposed)

    def padded_table(self, slot: int, table: BlockTable | None, positions: int) -> np.ndarray:
        """The server's `table` for `positions` (GraphInputs.table checks and pads it); none: the
        slot's fixed table."""
        try:
            return (
                self.graphs.inputs.table(table, positions)
                if table is not None
                else self.graphs.inputs.slot_table(int(slot))
            )
        except ValueError as exc:
            raise RunnerError(str(exc)) from exc

    def tokens(self, prompt: Sequence[int]) -> np.ndarray:
        tokens = np.asarray(prompt, dtype=np.int64)
        if tokens.ndim != 1 or tokens.size == 0:
            raise RunnerError("the prompt must be a non-empty list of token ids")
        if tokens.min() < 0 or tokens.max() >= self.spec.vocab_size:
            raise RunnerError(f"token ids must lie in 0..{self.spec.vocab_size - 1}")
        return tokens
