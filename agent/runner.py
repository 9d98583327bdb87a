"""ModelRunner: owns the model's graphs and its KV slots; the agent process calls it.

    runner = ModelRunner.from_checkpoint(checkpoint, runtime)  # weights and KV cache on the device
    runner = ModelRunner.from_mindir(files, runtime)  # or runs graphs exported by tools.export
    runner = ModelRunner(graphs, runtime)       # or over any graph set (agent/graphs/interface.py)
    reply = runner.execute(StepRequest(chunks=[StepChunk(slot, ids, table, 0, sampling)]))  # a prompt
    reply = runner.execute(StepRequest(slots=[slot, ...], tables=[table, ...]))  # a decode step
    reply.decoded[i][0].token, reply.firsts[0].token  # each slot's tokens, each chunk's first
    runner.release(slot)

One entry point, one step (agent/contract/step.py StepRequest, the wire's `step`) in, its StepReply
out: the tokens with their logprobs and faults, and the prompt logprobs a chunk asked for. Inside,
a step runs the graph it needs: the decode graphs for decode slots alone (_decode), the prefill
graphs for one prompt chunk alone (_prefill), the mixed graph for both, or proposals (_mixed).
The runner holds its slots (SlotTable, agent/slots.py), the checks of each call (StepChecks,
agent/step_checks.py) and the token choice (TokenChooser, agent/token_chooser.py).

PD disaggregation moves a prefilled slot to another agent's runner (agent/kv_transfer.py).

A slot is a batch row: the runner keeps its length, its table, its sampler and its sampled-but-not-yet-
written token. The KV cache is a pool of blocks (agent/graphs/interface.py) that the server hands out:
every call names the blocks of each sequence (its block table), and a table may grow between calls.
Without a table, a slot uses its fixed one (GraphInputs.slot_table: tools and tests). Shapes are
padded to the configured buckets: padded decode rows and padded prefill positions write to the
scratch blocks, which are not part of the pool the server hands out (`num_blocks`).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import cast

import mindspore as ms
import numpy as np
from mindspore import Tensor

from agent.contract.prompt_logprobs import PromptLogprob, score_rows
from agent.contract.step import BlockTable, StepChunk, StepLimits, StepRequest
from agent.contract.step_reply import StepReply
from agent.graphs.cache_format import CacheFormat
from agent.graphs.interface import (
    KVTransferGraphs,
    MixedStepGraphs,
    ModelGraphs,
    PoolingGraphs,
    StateMove,
    bucket,
)
from agent.graphs.layers import WHOLE_MODEL, TensorSplit
from agent.graphs.mindir import MindIRGraphs
from agent.graphs.step_graphs import StepGraphs
from agent.launcher.preflight import require_device
from agent.model.checkpoint import Checkpoint
from agent.slots import RunnerError, SlotState, SlotTable
from agent.step_checks import StepChecks
from agent.token_chooser import TokenChooser
from config.schema import ModelSection, RuntimeSection

log = logging.getLogger(__name__)


def memory_size(mb: int) -> str:
    """MB as MindSpore's memory settings take it ("xxGB"), rounded up: never under the budget."""
    return f"{math.ceil(mb * 1000 / 1024) / 1000}GB"


def configure_mindspore(runtime: RuntimeSection, device_id: int = 0) -> None:
    """The process-wide MindSpore context; call once per process before building a runner. On
    Ascend/GPU: the device checked first (DeviceUnavailable: one line per problem, no traceback
    from deep in MindSpore), its memory pool capped at memory_budget_mb (models sharing a device
    each keep to their own plan) and its jit_config (runtime.jit_config: the compile level, and
    MindSpore's internal inference kernels on Ascend)."""
    device = runtime.device_target != "CPU"
    if device:
        require_device(runtime.device_target, device_id)
    ms.set_context(mode=ms.GRAPH_MODE)
    ms.set_device(runtime.device_target, device_id)
    if runtime.jit_config:
        ms.set_context(jit_config=runtime.jit_config)
    if device and runtime.memory_budget_mb is not None:
        ms.runtime.set_memory(max_size=memory_size(runtime.memory_budget_mb))
    if runtime.cpu_threads is not None and runtime.device_target == "CPU":
        from mindspore.device_context.cpu.op_tuning import threads_num

        threads_num(runtime.cpu_threads)


class ModelRunner:
    def __init__(self, graphs: ModelGraphs, runtime: RuntimeSection):
        """A runner over a graph set built for `runtime` (agent.graphs.mindir.GraphExporter: every warm-up
        call exports its graph)."""
        self.graphs = graphs
        self.spec = graphs.spec
        self.runtime = runtime
        self.topk_buckets = graphs.topk_buckets
        self.slot_table = SlotTable(runtime.planned_num_slots)
        self.chooser = TokenChooser(graphs)  # the host side of each call's token choice
        self.checks = StepChecks(graphs, runtime, self.slot_table, self.chooser)

    @classmethod
    def from_checkpoint(
        cls, checkpoint: Checkpoint, runtime: RuntimeSection, split: TensorSplit = WHOLE_MODEL
    ) -> ModelRunner:
        """Graphs built from the weights; split: this process's share of a tensor-parallel group
        (every rank runs the same calls)."""
        return cls(StepGraphs(checkpoint, runtime, split), runtime)

    @classmethod
    def from_mindir(cls, files: ModelSection, runtime: RuntimeSection) -> ModelRunner:
        """Run the graphs of MindIR files (the model section's *_model files) written by tools.export."""
        return cls(MindIRGraphs(files, runtime), runtime)

    # -------------------------------------------------------------------------------- slots and limits

    @property
    def num_slots(self) -> int:
        return self.slot_table.num_slots

    @property
    def slots(self) -> dict[int, SlotState]:
        """The occupied slots' states (a slot not here is free)."""
        return self.slot_table.slots

    def active(self, slot: int) -> SlotState:
        """The state of an occupied slot (RunnerError for a free one)."""
        return self.slot_table.active(slot)

    def release(self, slot: int) -> None:
        self.slot_table.release(slot)

    @property
    def max_len(self) -> int:
        return self.checks.max_len

    @property
    def mixed_rows(self) -> int:
        """Rows of one mixed step, 0 where these graphs run none."""
        return self.checks.mixed_rows

    @property
    def max_prompt_len(self) -> int:
        return self.checks.max_prompt_len

    @property
    def max_chunk(self) -> int:
        return self.checks.max_chunk

    @property
    def num_blocks(self) -> int:
        return self.checks.num_blocks

    @property
    def chunked_prefill(self) -> bool:
        return self.checks.chunked_prefill

    @property
    def prefix_caching(self) -> bool:
        return self.checks.prefix_caching

    @property
    def max_proposals(self) -> int:
        return self.checks.max_proposals

    @property
    def limits(self) -> StepLimits:
        return self.checks.limits

    def padded_table(self, slot: int, table: BlockTable | None, positions: int) -> np.ndarray:
        return self.checks.padded_table(slot, table, positions)

    # -------------------------------------------------------------------------------- the step

    def execute(self, request: StepRequest) -> StepReply:
        """One agent step (agent/contract/step.py StepRequest) through the graph it needs: a decode
        of its slots alone, one prompt chunk alone (the prefill graphs), or both and proposals in
        one mixed call. The reply holds each decode slot's tokens and each chunk's first token (None
        unless it samples), each with its logprobs and its sequence's fault (Sampled), and the
        prompt logprobs a chunk asked for (a chunk that asks runs alone). Its `drafts` are token
        lists (the agent's drafter turns a count into its tokens first); its transfer and tier moves
        are the agent service's (agent/service.py). Tools and tests may leave out the block tables:
        a request without `tables` decodes each slot in its table of its last call, a chunk whose
        table is None is computed in the slot's fixed one (GraphInputs.slot_table)."""
        drafts: dict[int, Sequence[int]] = {}
        for slot, proposal in request.drafts.items():
            if isinstance(proposal, int):
                raise RunnerError(
                    f"slot {slot} asks for {proposal} proposals: the agent's drafter makes them"
                )
            drafts[slot] = proposal
        slots, chunks = list(request.slots), list(request.chunks)
        tables = list(request.tables) if request.tables or not slots else None
        if any(isinstance(_pool(c), str) for c in chunks) and not isinstance(self.graphs, PoolingGraphs):
            raise RunnerError(
                "these graphs keep no hidden states (MindIR exports compute logits only): serve "
                "embeddings from the model's weights (model.path)"
            )
        for chunk in chunks:
            if _pool(chunk) in ("mean", "cls") and chunk.start > 0:
                raise RunnerError(
                    f"{_pool(chunk)} pooling needs the whole prompt in one call, not a chunk from "
                    f"position {chunk.start}"
                )
        decoded, firsts, scores, pooled = self._run(slots, tables, chunks, request.masks, drafts)
        sampled = self.slot_table.sampled
        return StepReply(
            [sampled(slot, tokens) for slot, tokens in zip(slots, decoded)],
            [None if t is None else sampled(c.slot, [t])[0] for c, t in zip(chunks, firsts)],
            prompts=[None if c.prompt_logprobs is None else scores for c in chunks],
            pooled=pooled if any(p is not None for p in pooled) else (),
        )

    def _run(
        self,
        slots: list[int],
        tables: list[BlockTable] | None,
        chunks: list[StepChunk],
        masks: Mapping[int, np.ndarray],
        drafts: Mapping[int, Sequence[int]],
    ) -> tuple[list[list[int]], list[int | None], list[PromptLogprob] | None, list[np.ndarray | None]]:
        """The step through the graph it needs: each decode slot's tokens, each chunk's first token
        (None unless it samples), the prompt logprobs of a chunk that asked (it runs alone), and each
        chunk's pooled vector (None unless it asked: SamplingParams.pool)."""
        if len(chunks) == 1 and not slots and not drafts:
            first, scores, pooled = self._prefill(chunks[0], masks)
            return [], [first], scores, pooled
        if any(c.prompt_logprobs is not None for c in chunks):
            raise RunnerError("a chunk that scores its prompt positions runs alone (a prefill step)")
        if chunks or drafts:
            decoded, firsts, pooled = self._mixed(slots, tables, chunks, masks, drafts)
            return decoded, firsts, None, pooled
        return [[t] for t in self._decode(slots, tables, masks)], [], None, []

    def _prefill(
        self, chunk: StepChunk, masks: Mapping[int, np.ndarray]
    ) -> tuple[int | None, list[PromptLogprob] | None, list[np.ndarray | None]]:
        """One chunk alone through the prefill graphs: positions chunk.start..len(chunk.tokens)-1
        (taking a free slot). The prompt's last chunk samples its first token (`masks`: the
        tokens it may be); a chunk before it, or the recompute of a preempted sequence (which keeps
        its sampler and pending token), samples nothing. Its first token (None where it samples
        none), its prompt logprobs (None where it asked none) and its pooled vector (in a list)."""
        if masks:
            self.chooser.check_masks(masks, [chunk.slot] if chunk.sample else [])
        sampler = None
        if chunk.sampling is not None:
            sampler = self.chooser.sampler(chunk.sampling, chunk.tokens)  # refused before anything runs
            if chunk.slot in masks:
                sampler.constrain(masks[chunk.slot])
        state, logits, scores, last_row = self._compute(chunk)
        if sampler is None:
            return None, scores, [None]
        pooled = self._pooled([chunk], {0: (0, 0, last_row)}, logits)
        state.sampler = sampler
        state.next_token = self.chooser.sample(logits, [sampler])[0]
        return state.next_token, scores, pooled

    def _compute(self, chunk: StepChunk) -> tuple[SlotState, Tensor, list[PromptLogprob] | None, int]:
        """Checks, then the chunk's positions through the prefill graphs in pieces of at most the
        largest bucket (a free slot is taken): the slot's state, the last piece's logits, where the
        chunk asks for prompt logprobs (k, lookahead) every row's logits scored at the token after it
        (the last row at `lookahead`, if any: StepChunk.scores), and the last row's place in the last
        call's rows (and in its logits under prompt logprobs, where every row has them)."""
        slot, start, k = chunk.slot, chunk.start, chunk.prompt_logprobs
        ids, padded = self.checks.chunk(chunk)
        if k is not None and chunk.lookahead is not None:
            self.checks.tokens([chunk.lookahead])
        after = np.append(ids[1:], -1 if k is None or chunk.lookahead is None else chunk.lookahead)
        scores: list[PromptLogprob] = []
        for piece_start in range(start, len(ids), self.max_chunk):
            piece = ids[piece_start : piece_start + self.max_chunk]
            length = bucket(self.runtime.prefill_buckets, len(piece))
            # a snapshot restored before the first piece, saved after the last
            move = self._state_move(chunk, piece_start == start, piece_start + len(piece) == len(ids))
            logits = self.graphs.prefill(
                padded,
                piece,
                length,
                start=piece_start,
                slot=slot,
                every_row=k is not None,
                moves={slot: move} if move else None,
            )
            if k is not None:
                rows = logits.asnumpy()[: len(piece)]
                targets = after[piece_start : piece_start + len(piece)]
                scored = int(np.count_nonzero(targets >= 0))  # only the last row may have none
                scores += score_rows(rows[:scored], targets[:scored], k)
                logits = Tensor(rows[-1:])
        last_row = len(piece) - 1
        return self.slot_table.computed(slot, ids, padded), logits, None if k is None else scores, last_row

    def _decode(
        self,
        slots: Sequence[int],
        tables: Sequence[BlockTable] | None,
        masks: Mapping[int, np.ndarray],
    ) -> list[int]:
        """One step for each slot through the decode graphs: write its pending token, return its
        next token (same order). `tables`: each slot's block table, covering its next position
        (None: as last time); `masks`: slot -> the tokens its next token may be (structured
        output)."""
        if not slots:
            raise RunnerError("decode needs at least one slot")
        states, padded = self.checks.decode(slots, tables)
        self.chooser.constrain(masks, dict(zip(slots, states)))
        positions = np.array([s.length for s in states], np.int64)
        rows = bucket(self.runtime.decode_batch_buckets, len(slots))
        logits, greedy = self.graphs.decode(
            np.stack(padded),
            np.array([s.next_token for s in states], np.int64),
            positions,
            rows,
            self.graphs.inputs.attend(positions),
            slots=list(slots),
            moves={slot: StateMove(replay=s.replay) for slot, s in zip(slots, states) if s.replay},
        )
        for state in states:
            state.replay = 0
        tokens = self.chooser.sample(logits, [s.sampler for s in states if s.sampler is not None], greedy)
        self.slot_table.decoded(states, padded, [[t] for t in tokens])
        return tokens

    def _mixed(
        self,
        slots: Sequence[int],
        tables: Sequence[BlockTable] | None,
        chunks: Sequence[StepChunk],
        masks: Mapping[int, np.ndarray],
        drafts: Mapping[int, Sequence[int]],
    ) -> tuple[list[list[int]], list[int | None], list[np.ndarray | None]]:
        """A decode step of `slots` and the prompt `chunks` in one call of the mixed graph, which
        reads the weights once (decode and prefill called back to back read them twice): each decode
        slot's tokens and each chunk's first token (None unless it samples). `drafts`: slot -> the
        tokens proposed after its pending token (speculative decoding): that slot's rows are its
        pending token and the proposals, each verified by its sampler (SlotSampler.verify), and its
        tokens are the proposals kept and one more; another slot's are its one next token. The KV of
        the proposals not kept is left behind its length, to be written over. Everything is checked
        before anything runs: a refused step changes nothing."""
        states, padded, checked = self.checks.mixed(slots, tables, chunks, masks, drafts)
        plain = [i for i, slot in enumerate(slots) if slot not in drafts]
        scored = []
        for i, slot in enumerate(slots):
            pending = states[i].next_token
            if slot in drafts and pending is not None:  # checked: a decode slot has its next token
                scored.append(
                    StepChunk(slot, [pending, *drafts[slot]], padded[i], states[i].length, scored=True)
                )
        # the sampling chunks' last rows' logits follow the decode and the scored rows'
        new = {
            i: self.chooser.sampler(c.sampling, c.tokens)
            for i, c in enumerate(chunks)
            if c.sampling is not None
        }
        sampling = list(new)
        if masks:
            self.chooser.constrain(
                masks, {**dict(zip(slots, states)), **{chunks[i].slot: new[i] for i in sampling}}
            )
        graphs = cast(MixedStepGraphs, self.graphs)  # StepChecks.mixed: mixed_rows says so
        # the verified slots' Gated DeltaNet states are held: the next step replays the rows kept
        moves = {
            slot: StateMove(replay=s.replay, hold=slot in drafts)
            for slot, s in zip(slots, states)
            if s.replay or slot in drafts
        }
        moves |= {c.slot: move for c in chunks if (move := self._state_move(c, True, True))}
        logits, greedy = graphs.mixed(
            np.stack([padded[i] for i in plain]) if plain else np.zeros((0, 0), np.int32),
            np.array([states[i].next_token for i in plain], np.int64),
            np.array([states[i].length for i in plain], np.int64),
            [
                *scored,
                *(replace(c, tokens=ids.tolist(), table=table) for c, (ids, table) in zip(chunks, checked)),
            ],
            self.mixed_rows,
            bucket(
                self.runtime.decode_batch_buckets, len(plain) + sum(len(c.tokens) for c in scored) + len(new)
            ),
            decode_slots=[slots[i] for i in plain],
            moves=moves,
        )
        samplers = [s for i in plain if (s := states[i].sampler) is not None] + [new[i] for i in sampling]
        if scored:
            by_slot = {slot: states[i].sampler for i, slot in enumerate(slots)}
            tokens, verified = self.chooser.verify(logits, greedy, samplers, len(plain), scored, by_slot)
        else:
            tokens, verified = self.chooser.sample(logits, samplers, greedy), {}
        decoded = [verified[slot] if slot in drafts else [] for slot in slots]
        for row, i in enumerate(plain):
            decoded[i] = [tokens[row]]
        self.slot_table.decoded(states, padded, decoded)
        for slot, state, kept in zip(slots, states, decoded):
            state.replay = len(kept) if slot in drafts else 0  # its pending token and the proposals kept
        firsts: list[int | None] = [None] * len(chunks)
        for i, token in zip(sampling, tokens[len(plain) :]):
            firsts[i] = token
        # the sampling chunks' logit rows follow the decode and scored rows', as their rows do
        first_row = len(plain) + sum(len(c.tokens) for c in scored)
        ends = first_row + np.cumsum([len(ids) - c.start for c, (ids, _) in zip(chunks, checked)])
        starts = {i: int(ends[i - 1]) if i else first_row for i in sampling}
        rows = {i: (first_row + at, starts[i], int(ends[i]) - 1) for at, i in enumerate(sampling)}
        pooled = self._pooled(chunks, rows, logits)
        for i, (chunk, (ids, table)) in enumerate(zip(chunks, checked)):
            state = self.slot_table.computed(chunk.slot, ids, table)
            if chunk.sample:
                state.sampler, state.next_token = new[i], firsts[i]
        return decoded, firsts, pooled

    # -------------------------------------------------------------------------------- internals

    def _pooled(
        self, chunks: Sequence[StepChunk], rows: Mapping[int, tuple[int, int, int]], logits: Tensor
    ) -> list[np.ndarray | None]:
        """Each sampling chunk's pooled vector (SamplingParams.pool), float32, None where it asked
        none: chunk i's last row is row rows[i][0] of the call's `logits` (the pool's token ids'
        logits), and its rows are rows rows[i][1]..rows[i][2] of the call's final hidden states. A
        hidden state pooled goes through the model's projections (PoolingGraphs.projection). Each
        output leaves the device once a step, and only where a chunk asks for it."""
        pools = {i: pool for i in rows if (pool := _pool(chunks[i])) is not None}
        out: list[np.ndarray | None] = [None] * len(chunks)
        if not pools:
            return out
        graphs = cast(PoolingGraphs, self.graphs)  # execute checked the graphs keep them
        pooling_states = any(isinstance(p, str) for p in pools.values())
        states = graphs.hidden.asnumpy() if graphs.hidden is not None and pooling_states else np.zeros(0)
        host = logits.asnumpy() if not all(isinstance(p, str) for p in pools.values()) else np.zeros(0)
        for i, pool in pools.items():
            row, first, last = rows[i]
            if isinstance(pool, tuple):
                out[i] = np.ascontiguousarray(host[row, list(pool)], np.float32)
                continue
            if pool == "mean":
                vector = states[first : last + 1].mean(axis=0, dtype=np.float64)
            else:
                vector = states[last if pool == "hidden" else first]
            for matrix in graphs.projection:
                vector = matrix @ vector
            out[i] = np.ascontiguousarray(vector, np.float32)
        return out

    def _state_move(self, chunk: StepChunk, first: bool, last: bool) -> StateMove | None:
        """A chunk's snapshot restore (before its first piece) and save (after its last), as state
        slots: the snapshots follow the live ones (GraphInputs: the slots and a scratch one); a
        chunk that goes on from its slot's state replays the rows that state still holds first."""
        live = self.graphs.inputs.num_slots + 1
        restore = chunk.restore if first else None
        save = chunk.save if last else None
        held = self.slot_table.slots.get(chunk.slot)
        replay = held.replay if first and restore is None and chunk.start > 0 and held is not None else 0
        if restore is None and save is None and not replay:
            return None
        return StateMove(
            replay=replay,
            restore=-1 if restore is None else live + restore,
            save=-1 if save is None else live + save,
        )

    def kv_graphs(self) -> KVTransferGraphs:
        if not isinstance(self.graphs, KVTransferGraphs):
            raise RunnerError("these graphs do not transfer KV (MindIR exports hold no KV transfer graphs)")
        return self.graphs

    def cache_dtype(self):
        return CacheFormat.of(self.runtime).numpy_dtype

    def cache_row_width(self) -> int:
        """The last dimension of the K/V that PD transfer and the tiers move: the head dim, or a q8_0
        row's bytes."""
        return CacheFormat.of(self.runtime).row_width(self.spec.head_dim)


def _pool(chunk: StepChunk):
    return None if chunk.sampling is None else chunk.sampling.pool
