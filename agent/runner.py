"""ModelRunner: owns the model's graphs and its KV slots; the agent process calls it.

    runner = ModelRunner.from_checkpoint(checkpoint, runtime)  # weights and KV cache on the device
    runner = ModelRunner.from_mindir(files, runtime)  # or runs graphs exported by tools.export
    runner = ModelRunner(graphs, runtime)       # or over any graph set (agent/graphs/interface.py)
    first = runner.prefill(slot, prompt_ids, sampling, table)          # the whole prompt
    runner.prefill_chunk(slot, ids[:end], table, start)  # or a chunk before the prompt's last
    nexts = runner.decode([slot, ...], [table, ...])  # one token for each slot, in order
    nexts, firsts = runner.step([slot, ...], [table, ...], [StepChunk(...), ...])  # both, one call
    nexts, firsts = runner.run(slots, tables, chunks, masks, drafts)  # any of them: an agent step
    runner.release(slot)

PD disaggregation moves a prefilled slot to another agent's runner (agent/kv_transfer.py).

A slot is a seat: the runner keeps its length, its table, its sampler and its sampled-but-not-yet-
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

from agent.checked_slots import CheckedSlots
from agent.contract.prompt_logprobs import PromptLogprob, score_rows
from agent.contract.sampling import SamplingParams
from agent.contract.step import BlockTable, StepChunk
from agent.graphs.cache_format import CacheFormat
from agent.graphs.interface import KVTransferGraphs, MixedStepGraphs, ModelGraphs, bucket
from agent.graphs.layers import WHOLE_MODEL, TensorSplit
from agent.graphs.mindir import MindIRGraphs
from agent.graphs.step_graphs import StepGraphs
from agent.launcher.preflight import require_device
from agent.model.checkpoint import Checkpoint
from agent.slots import RunnerError, SlotState
from config.schema import ModelSection, RuntimeSection

log = logging.getLogger(__name__)

Score = tuple[int, int | None]  # prompt logprobs asked of a chunk: (k, lookahead token id or None)


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


class ModelRunner(CheckedSlots):
    def __init__(self, graphs: ModelGraphs, runtime: RuntimeSection):
        """A runner over a graph set built for `runtime` (agent.graphs.mindir.GraphExporter: every warm-up
        call exports its graph)."""
        super().__init__(graphs, runtime)
        self.topk_buckets = graphs.topk_buckets
        # the prompt logprobs the last run()'s one chunk asked for (StepChunk.prompt_logprobs)
        self.prompt_scores: list[PromptLogprob] | None = None

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

    # -------------------------------------------------------------------------------- requests

    def prefill(
        self,
        slot: int,
        tokens: Sequence[int],
        params: SamplingParams,
        table: BlockTable | None = None,
        start: int = 0,
        mask: np.ndarray | None = None,
        score: Score | None = None,
    ) -> int:
        """A prompt's last (or only) chunk: positions start..len(tokens)-1 (`tokens`: the ids from
        position 0; positions before `start` are in the blocks of `table` already: earlier chunks,
        a prefix-cache hit). Seats a free slot; returns the first generated token (`mask`: the
        tokens it may be, as SlotSampler.constrain takes them; `score`: its prompt logprobs, into
        `prompt_scores`)."""
        sampler = self.sampling.sampler(params, tokens)  # a bad parameter is refused before anything runs
        if mask is not None:
            self.sampling.check_masks({slot: mask}, [slot])
            sampler.constrain(mask)
        state, logits = self._compute(slot, tokens, table, start, sample=True, score=score)
        state.sampler = sampler
        state.next_token = self.sampling.sample(logits, [sampler])[0]
        return state.next_token

    def prefill_chunk(
        self, slot: int, tokens: Sequence[int], table: BlockTable, start: int = 0, score: Score | None = None
    ) -> None:
        """Positions start..len(tokens)-1 without sampling: a prompt's chunk before its last, or
        the recompute of a preempted sequence (which keeps its sampler and pending token)."""
        self._compute(slot, tokens, table, start, sample=False, score=score)

    def _compute(
        self,
        slot: int,
        tokens: Sequence[int],
        table: BlockTable | None,
        start: int,
        sample: bool,
        score: Score | None = None,
    ) -> tuple[SlotState, Tensor]:
        """Checks, then the positions start.. through the prefill graphs in pieces of at most the
        largest bucket (a free slot is seated): the slot's state and the last piece's logits.
        `score` (k, lookahead): every row's logits too, each row scored at the token after it
        (the last row at `lookahead`, if any), into `prompt_scores` (StepChunk.scores)."""
        ids, padded = self._check_chunk(slot, tokens, table, start, sample)
        if score is not None and score[1] is not None:
            self._check_tokens([score[1]])
        end = len(ids)
        after = np.append(ids[1:], -1 if score is None or score[1] is None else score[1])
        scores: list[PromptLogprob] = []
        pieces = range(start, end, self.max_chunk)
        for piece_start in pieces:
            piece = ids[piece_start : piece_start + self.max_chunk]
            length = bucket(self.runtime.prefill_buckets, len(piece))
            logits = self.graphs.prefill(
                padded, piece, length, start=piece_start, slot=slot, every_row=score is not None
            )
            if score is not None:
                rows = logits.asnumpy()[: len(piece)]
                targets = after[piece_start : piece_start + len(piece)]
                scored = int(np.count_nonzero(targets >= 0))  # only the last row may have none
                scores += score_rows(rows[:scored], targets[:scored], score[0])
                logits = Tensor(rows[-1:])
        if score is not None:
            self.prompt_scores = scores
        return self._computed(slot, ids, padded), logits

    def decode(
        self,
        slots: Sequence[int],
        tables: Sequence[BlockTable] | None = None,
        masks: Mapping[int, np.ndarray] | None = None,
    ) -> list[int]:
        """One step for each slot: write its pending token, return its next token (same order).
        `tables`: each slot's block table, covering its next position (none: as last time);
        `masks`: slot -> the tokens its next token may be (structured output)."""
        if not slots:
            raise RunnerError("decode needs at least one slot")
        states, padded = self._check_decode(slots, tables)
        self.sampling.constrain(masks or {}, dict(zip(slots, states)))
        positions = np.array([s.length for s in states], np.int64)
        rows = bucket(self.runtime.decode_batch_buckets, len(slots))
        logits, greedy = self.graphs.decode(
            np.stack(padded),
            np.array([s.next_token for s in states], np.int64),
            positions,
            rows,
            self.graphs.inputs.attend(positions),
            slots=list(slots),
        )
        tokens = self.sampling.sample(logits, [s.sampler for s in states if s.sampler is not None], greedy)
        self._decoded(states, padded, [[t] for t in tokens])
        return tokens

    def run(
        self,
        slots: Sequence[int],
        tables: Sequence[BlockTable],
        chunks: Sequence[StepChunk],
        masks: Mapping[int, np.ndarray] | None = None,
        drafts: Mapping[int, Sequence[int]] | None = None,
    ) -> tuple[list[list[int]], list[int | None]]:
        """An agent step (agent/contract/step.py StepRequest) through the graph it needs: a decode
        of `slots` alone, one prompt chunk alone (the prefill graphs), or both and proposals in one
        mixed call (step). Each decode slot's tokens and each chunk's first token (None unless it
        samples)."""
        self.prompt_scores = None
        if len(chunks) != 1 or slots or drafts:
            if any(c.prompt_logprobs is not None for c in chunks):
                raise RunnerError("a chunk that scores its prompt positions runs alone (a prefill step)")
            if chunks or drafts:
                return self.step(slots, tables, chunks, masks, drafts)
            return [[t] for t in self.decode(slots, tables, masks)], []
        (chunk,) = chunks
        masks = masks or {}
        if masks:
            self.sampling.check_masks(masks, [chunk.slot] if chunk.sampling is not None else [])
        score = None if chunk.prompt_logprobs is None else (chunk.prompt_logprobs, chunk.lookahead)
        if chunk.sampling is None:
            self.prefill_chunk(chunk.slot, chunk.tokens, chunk.table, chunk.start, score)
            return [], [None]
        mask = masks.get(chunk.slot)
        return [], [
            self.prefill(chunk.slot, chunk.tokens, chunk.sampling, chunk.table, chunk.start, mask, score)
        ]

    def step(
        self,
        slots: Sequence[int],
        tables: Sequence[BlockTable],
        chunks: Sequence[StepChunk],
        masks: Mapping[int, np.ndarray] | None = None,
        drafts: Mapping[int, Sequence[int]] | None = None,
    ) -> tuple[list[list[int]], list[int | None]]:
        """A decode step of `slots` and the prompt `chunks` in one graph call, which reads the
        weights once (decode and prefill called back to back read them twice): each decode slot's
        tokens and each chunk's first token (None unless it samples). `drafts`: slot -> the tokens
        proposed after its pending token (speculative decoding): that slot's rows are its pending
        token and the proposals, each verified by its sampler (SlotSampler.verify), and its tokens
        are the proposals kept and one more; another slot's are its one next token. The KV of the
        proposals not kept is left behind its length, to be written over. Everything is checked
        before anything runs: a refused step changes nothing."""
        drafts = dict(drafts or {})
        states, padded, checked = self._check_step(slots, tables, chunks, masks or {}, drafts)
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
            i: self.sampling.sampler(c.sampling, c.tokens)
            for i, c in enumerate(chunks)
            if c.sampling is not None
        }
        sampling = list(new)
        if masks:
            self.sampling.constrain(
                masks, {**dict(zip(slots, states)), **{chunks[i].slot: new[i] for i in sampling}}
            )
        graphs = cast(MixedStepGraphs, self.graphs)  # _check_step: mixed_rows says so
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
        )
        samplers = [s for i in plain if (s := states[i].sampler) is not None] + [new[i] for i in sampling]
        if scored:
            by_slot = {slot: states[i].sampler for i, slot in enumerate(slots)}
            tokens, verified = self.sampling.verify(logits, greedy, samplers, len(plain), scored, by_slot)
        else:
            tokens, verified = self.sampling.sample(logits, samplers, greedy), {}
        decoded = [verified[slot] if slot in drafts else [] for slot in slots]
        for row, i in enumerate(plain):
            decoded[i] = [tokens[row]]
        self._decoded(states, padded, decoded)
        firsts: list[int | None] = [None] * len(chunks)
        for i, token in zip(sampling, tokens[len(plain) :]):
            firsts[i] = token
        for i, (chunk, (ids, table)) in enumerate(zip(chunks, checked)):
            state = self._computed(chunk.slot, ids, table)
            if chunk.sample:
                state.sampler, state.next_token = new[i], firsts[i]
        return decoded, firsts

    # -------------------------------------------------------------------------------- internals

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
