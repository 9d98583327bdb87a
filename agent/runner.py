"""ModelRunner: owns the model's graphs and its KV slots; the agent process calls it.

    runner = ModelRunner.from_checkpoint(checkpoint, runtime)  # weights and KV cache on the device
    runner = ModelRunner.from_mindir(files, runtime)  # or runs graphs exported by tools.export
    runner = ModelRunner(graphs, runtime)       # or over any graph set (agent/graphs/interface.py)
    first = runner.prefill(slot, prompt_ids, sampling, table)          # the whole prompt
    runner.prefill(slot, ids[:end], sampling, table, start, sample=False)  # or a chunk of it
    nexts = runner.decode([slot, ...], [table, ...])  # one token for each slot, in order
    nexts, firsts = runner.step([slot, ...], [table, ...], [StepChunk(...), ...])  # both, one call
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
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import TypeVar

import mindspore as ms
import numpy as np
from mindspore import Tensor

from agent.contract.sampling import NO_TOKEN, SamplingParams, SequenceFault, TokenLogprob
from agent.contract.step import StepChunk
from agent.graphs.decoder import WHOLE_MODEL, TensorSplit
from agent.graphs.interface import KVTransferGraphs, MixedStepGraphs, ModelGraphs, bucket, mixed_rows
from agent.graphs.mindir import MindIRGraphs
from agent.graphs.step_graphs import LlamaGraphs
from agent.model.checkpoint import Checkpoint
from agent.sampling import SamplingFault, SlotSampler
from config.schema import ModelSection, RuntimeSection

log = logging.getLogger(__name__)

MAX_DRAFT_TOKENS = 16  # tokens proposed for one slot in one step (speculative decoding)

# A sequence's blocks, position p in block table[p // block_size].
BlockTable = Sequence[int] | np.ndarray


Choice = TypeVar("Choice")


def guarded(sampler: SlotSampler, choose: Callable[[], Choice], failed: Choice) -> Choice:
    """One sequence's choice, or `failed` with the sampler's fault set: a failed choice is that
    sequence's error, the others of the step go on."""
    try:
        return choose()
    except SamplingFault as exc:
        sampler.fault = exc.fault()
    except Exception as exc:  # a bug in one row's choice: that sequence's error, logged
        log.exception("sampling one sequence's token failed")
        sampler.fault = SequenceFault("internal", f"sampling failed: {type(exc).__name__}: {exc}")
    return failed


class RunnerError(ValueError):
    """A request the runner cannot serve (bad slot, prompt too long...); the message says why."""


@dataclass
class SlotState:
    length: int  # positions written to the KV cache
    table: np.ndarray  # its block table [MB], as of the last call
    next_token: int | None = None  # sampled, to be written by the next decode step
    sampler: SlotSampler | None = None  # none until the prompt's last chunk samples
    # the ids of the positions written (a draft model catches up from them); None where the KV
    # came from elsewhere (a KV import) or the runner keeps none (no draft model)
    tokens: list[int] | None = None


def configure_mindspore(
    runtime: RuntimeSection, device_id: int = 0, compile_cache: Path | None = None
) -> None:
    """The process-wide MindSpore context; call once per process before building a runner."""
    ms.set_context(mode=ms.GRAPH_MODE)
    ms.set_device(runtime.device_target, device_id)
    if runtime.cpu_threads is not None and runtime.device_target == "CPU":
        from mindspore.device_context.cpu.op_tuning import threads_num

        threads_num(runtime.cpu_threads)
    if compile_cache is not None:
        compile_cache.mkdir(parents=True, exist_ok=True)
        ms.set_context(enable_compile_cache=True, compile_cache_path=str(compile_cache))


class ModelRunner:
    def __init__(self, graphs: ModelGraphs, runtime: RuntimeSection):
        """A runner over a graph set built for `runtime` (agent.graphs.mindir.GraphExporter: every warm-up
        call exports its graph)."""
        self.graphs = graphs
        self.spec = graphs.spec
        self.runtime = runtime
        self.num_slots, self.max_len = runtime.planned_num_slots, runtime.planned_max_seq_len
        self.topk_buckets = graphs.topk_buckets
        self.slots: dict[int, SlotState] = {}
        self.track_tokens = False  # keep each slot's token ids (a draft model follows them)

    @classmethod
    def from_checkpoint(
        cls, checkpoint: Checkpoint, runtime: RuntimeSection, split: TensorSplit = WHOLE_MODEL
    ) -> ModelRunner:
        """Graphs built from the weights; split: this process's share of a tensor-parallel group
        (every rank runs the same calls)."""
        return cls(LlamaGraphs(checkpoint, runtime, split), runtime)

    @classmethod
    def from_mindir(cls, files: ModelSection, runtime: RuntimeSection) -> ModelRunner:
        """Run the graphs of MindIR files (the model section's *_model files) written by tools.export."""
        return cls(MindIRGraphs(files, runtime), runtime)

    # ----------------------------------------------------------------------------------- state

    @property
    def free_slots(self) -> list[int]:
        return [s for s in range(self.num_slots) if s not in self.slots]

    def slot_length(self, slot: int) -> int:
        return self.active(slot).length

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
        """Whether a prefill may start after cached positions (chunks, prefix-cache hits)."""
        return self.graphs.inputs.fused_layers

    @property
    def prefix_caching(self) -> bool:
        """Whether a prompt may start from another sequence's blocks (a prefix-cache hit): not where
        sliding-window layers keep their KV in each seat's ring (agent/graphs/interface.py)."""
        return self.chunked_prefill and not self.graphs.inputs.ring

    @property
    def mixed_rows(self) -> int:
        """Rows of one mixed step (decode rows and prompt chunks in one graph call), 0 where these
        graphs run none."""
        if not isinstance(self.graphs, MixedStepGraphs) or not self.graphs.inputs.fused_layers:
            return 0
        return mixed_rows(self.runtime)

    @property
    def max_prompt_len(self) -> int:
        """The longest prompt: one position stays for an answer; without chunks, one graph call."""
        return self.max_len - 1 if self.chunked_prefill else min(self.max_len - 1, self.max_chunk)

    def release(self, slot: int) -> None:
        self.check_slot(slot)
        self.slots.pop(slot, None)

    # -------------------------------------------------------------------------------- requests

    def prefill(
        self,
        slot: int,
        tokens: Sequence[int],
        params: SamplingParams,
        table: BlockTable | None = None,
        start: int = 0,
        mask: np.ndarray | None = None,
    ) -> int:
        """A prompt's last (or only) chunk: positions start..len(tokens)-1 (`tokens`: the ids from
        position 0; positions before `start` are in the blocks of `table` already: earlier chunks,
        a prefix-cache hit). Seats a free slot; returns the first generated token (`mask`: the
        tokens it may be, as SlotSampler.constrain takes them)."""
        sampler = self._sampler(params, tokens)  # a bad parameter is refused before anything runs
        if mask is not None:
            self._check_masks({slot: mask}, [slot])
            sampler.constrain(mask)
        state, logits = self._compute(slot, tokens, table, start, sample=True)
        state.sampler = sampler
        state.next_token = self._sample(logits, [sampler])[0]
        return state.next_token

    def prefill_chunk(self, slot: int, tokens: Sequence[int], table: BlockTable, start: int = 0) -> None:
        """Positions start..len(tokens)-1 without sampling: a prompt's chunk before its last, or
        the recompute of a preempted sequence (which keeps its sampler and pending token)."""
        self._compute(slot, tokens, table, start, sample=False)

    def _compute(
        self, slot: int, tokens: Sequence[int], table: BlockTable | None, start: int, sample: bool
    ) -> tuple[SlotState, Tensor]:
        """Checks, then the positions start.. through the prefill graphs in pieces of at most the
        largest bucket (a free slot is seated): the slot's state and the last piece's logits."""
        ids, padded = self._check_chunk(slot, tokens, table, start, sample)
        end = len(ids)
        pieces = range(start, end, self.max_chunk)
        for piece_start in pieces:
            piece = ids[piece_start : piece_start + self.max_chunk]
            logits = self.graphs.prefill(
                padded, piece, bucket(self.runtime.prefill_buckets, len(piece)), start=piece_start, slot=slot
            )
        return self._computed(slot, ids, padded), logits

    def _computed(self, slot: int, ids: np.ndarray, table: np.ndarray) -> SlotState:
        """The slot (seated if free) holds positions 0..len(ids)-1, the KV of `ids`, in the blocks
        of `table`."""
        end = len(ids)
        state = self.slots.get(slot)
        if state is None:
            state = self.slots[slot] = SlotState(length=end, table=table)
        state.length, state.table = end, table
        state.tokens = ids.tolist() if self.track_tokens else None
        return state

    def _check_chunk(
        self, slot: int, tokens: Sequence[int], table: BlockTable | None, start: int, sample: bool
    ) -> tuple[np.ndarray, np.ndarray]:
        """A chunk's checks (nothing changes): its token ids and its table padded to MB blocks."""
        self.check_slot(slot)
        ids = self._check_tokens(tokens)
        end = len(ids)
        if end > self.max_prompt_len and (sample or not self.chunked_prefill):
            raise RunnerError(
                f"prompt of {end} tokens exceeds the longest prompt this agent accepts "
                f"({self.max_prompt_len} tokens)"
            )
        if end >= self.max_len:
            raise RunnerError(f"{end} positions do not fit max_seq_len {self.max_len}")
        state = self.slots.get(slot)
        if state is not None and sample and state.sampler is not None:
            raise RunnerError(f"slot {slot} has sampled already; release it first")
        # A free slot may start anywhere (a prefix-cache hit); a seated one not past what it holds.
        if not 0 <= start < end or (state is not None and start > state.length):
            raise RunnerError(
                f"a prefill computes positions start..{end - 1} after the "
                f"{0 if state is None else state.length} the slot holds, not from {start}"
            )
        return ids, self.padded_table(slot, table, end)

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
        self._constrain(masks or {}, dict(zip(slots, states)))
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
        tokens = self._sample(logits, [s.sampler for s in states if s.sampler is not None], greedy)
        self._decoded(states, padded, [[t] for t in tokens])
        return tokens

    def _check_decode(
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
        states = [self.active(s) for s in slots]
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

    @staticmethod
    def _decoded(states: list[SlotState], tables: list[np.ndarray], tokens: list[list[int]]) -> None:
        """Each slot wrote its pending token (and the proposals kept after it): `tokens`, each
        slot's tokens of the step, the last one pending now."""
        for state, table, chosen in zip(states, tables, tokens):
            state.table = table
            state.length += len(chosen)
            if state.tokens is not None and state.next_token is not None:
                state.tokens += [state.next_token, *chosen[:-1]]
            state.next_token = chosen[-1]

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
        if not self.mixed_rows:
            raise RunnerError("these graphs run no mixed steps (fused layers, graphs built here)")
        if not chunks and not drafts:
            raise RunnerError("a mixed step needs prompt chunks or proposals")
        chunk_slots = [c.slot for c in chunks]
        if len(set(chunk_slots)) != len(chunk_slots) or set(chunk_slots) & set(slots):
            raise RunnerError(f"a mixed step names a slot twice: decode {list(slots)}, chunks {chunk_slots}")
        self._check_drafts(drafts, slots, masks or {})
        states, padded = self._check_decode(slots, tables, drafts)
        checked = [self._check_chunk(c.slot, c.tokens, c.table, c.start, c.sample) for c in chunks]
        if masks:
            self._check_masks(masks, [*slots, *(c.slot for c in chunks if c.sample)])
        plain = [i for i, slot in enumerate(slots) if slot not in drafts]
        scored = []
        for i, slot in enumerate(slots):
            pending = states[i].next_token
            if slot in drafts and pending is not None:  # checked: a decode slot has its next token
                scored.append(
                    StepChunk(slot, [pending, *drafts[slot]], padded[i], states[i].length, scored=True)
                )
        prompt_rows = sum(len(ids) - c.start for c, (ids, _) in zip(chunks, checked))
        rows = len(plain) + sum(len(c.tokens) for c in scored) + prompt_rows
        seqs = len(slots) + len(chunks)
        largest = self.runtime.decode_batch_buckets[-1]
        logit_rows = len(plain) + sum(len(c.tokens) for c in scored) + sum(c.sample for c in chunks)
        if rows > self.mixed_rows or seqs > largest or logit_rows > largest:
            raise RunnerError(
                f"a mixed step of {rows} rows, {seqs} sequences and {logit_rows} rows of logits exceeds "
                f"{self.mixed_rows} rows or {largest} sequences and rows of logits"
            )
        # the sampling chunks' last rows' logits follow the decode and the scored rows'
        new = {i: self._sampler(c.sampling, c.tokens) for i, c in enumerate(chunks) if c.sampling is not None}
        sampling = list(new)
        if masks:
            self._constrain(masks, {**dict(zip(slots, states)), **{chunks[i].slot: new[i] for i in sampling}})
        assert isinstance(self.graphs, MixedStepGraphs)  # mixed_rows says so
        logits, greedy = self.graphs.mixed(
            np.stack([padded[i] for i in plain]) if plain else np.zeros((0, 0), np.int32),
            np.array([states[i].next_token for i in plain], np.int64),
            np.array([states[i].length for i in plain], np.int64),
            [
                *scored,
                *(replace(c, tokens=ids.tolist(), table=table) for c, (ids, table) in zip(chunks, checked)),
            ],
            self.mixed_rows,
            bucket(self.runtime.decode_batch_buckets, logit_rows),
            decode_slots=[slots[i] for i in plain],
        )
        samplers = [s for i in plain if (s := states[i].sampler) is not None] + [new[i] for i in sampling]
        if scored:
            by_slot = {slot: states[i].sampler for i, slot in enumerate(slots)}
            tokens, verified = self._verify(logits, greedy, samplers, len(plain), scored, by_slot)
        else:
            tokens, verified = self._sample(logits, samplers, greedy), {}
        decoded: list[list[int]] = [[] for _ in slots]
        for row, i in enumerate(plain):
            decoded[i] = [tokens[row]]
        for i, slot in enumerate(slots):
            if slot in drafts:
                decoded[i] = verified[slot]
        self._decoded(states, padded, decoded)
        firsts: list[int | None] = [None] * len(chunks)
        for i, token in zip(sampling, tokens[len(plain) :]):
            firsts[i] = token
        for i, (chunk, (ids, table)) in enumerate(zip(chunks, checked)):
            state = self._computed(chunk.slot, ids, table)
            if chunk.sample:
                state.sampler, state.next_token = new[i], firsts[i]
        return decoded, firsts

    def _verify(
        self,
        logits: Tensor,
        greedy: Tensor,
        samplers: list[SlotSampler],
        plain: int,
        scored: list[StepChunk],
        by_slot: Mapping[int, SlotSampler | None],
    ) -> tuple[list[int], dict[int, list[int]]]:
        """A step with scored rows (after the `plain` decode rows): the plain decode rows' and the
        sampling chunks' tokens (`samplers`, chosen as _sample chooses them, from those rows alone)
        and each scored slot's verified tokens. A plain greedy sampler keeps a proposal where the
        graph's argmax is it; the others verify on the host."""
        ids = greedy.asnumpy()
        all_greedy = all(s.plain_greedy for s in samplers)
        # the logits leave the device only for a row that is not plain greedy
        scored_greedy = all((s := by_slot[c.slot]) is not None and s.plain_greedy for c in scored)
        host = logits.asnumpy() if not (all_greedy and scored_greedy) else None
        sizes = [len(c.tokens) for c in scored]
        after = plain + sum(sizes)  # the sampling chunks' rows follow the scored ones
        normal = [*range(plain), *range(after, after + len(samplers) - plain)]
        if all_greedy:
            tokens = [int(t) for t in ids[normal]]  # as _sample chooses for plain greedy rows
        else:
            assert host is not None
            tokens = self._sample(Tensor(host[normal]), samplers, Tensor(ids[normal]))
        verified: dict[int, list[int]] = {}
        row = plain
        for chunk, size in zip(scored, sizes):
            sampler = by_slot[chunk.slot]
            assert sampler is not None  # checked: a decode slot has finished its prompt
            proposed = list(chunk.tokens[1:])
            if sampler.plain_greedy:
                kept = []
                for j in range(size):
                    kept.append(int(ids[row + j]))
                    sampler.observe(kept[-1])
                    if j == len(proposed) or kept[-1] != proposed[j]:
                        break
            else:
                assert host is not None  # fetched for every row that is not plain greedy
                kept = guarded(sampler, partial(sampler.verify, host[row : row + size], proposed), [NO_TOKEN])
            verified[chunk.slot] = kept
            row += size
        return tokens, verified

    def _check_drafts(
        self, drafts: Mapping[int, Sequence[int]], slots: Sequence[int], masks: Mapping[int, np.ndarray]
    ) -> None:
        """Proposals for decode slots of this call, at most MAX_DRAFT_TOKENS token ids each, and
        none for a slot whose next token is masked (a grammar's mask holds for one token only)."""
        for slot, proposed in drafts.items():
            if slot not in slots:
                raise RunnerError(f"proposals for slot {slot}, which this step does not decode")
            if slot in masks:
                raise RunnerError(f"slot {slot} has a token mask: its next token cannot be proposed")
            if not 1 <= len(proposed) <= MAX_DRAFT_TOKENS:
                raise RunnerError(f"a slot's proposals are 1..{MAX_DRAFT_TOKENS} tokens, got {len(proposed)}")
            self._check_tokens(proposed)

    # -------------------------------------------------------------------------------- internals

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

    def kv_graphs(self) -> KVTransferGraphs:
        if not isinstance(self.graphs, KVTransferGraphs):
            raise RunnerError("these graphs do not transfer KV (MindIR exports hold no KV transfer graphs)")
        return self.graphs

    def cache_dtype(self):
        return np.float16 if self.runtime.dtype == "float16" else np.float32

    def check_slot(self, slot: int) -> None:
        if not isinstance(slot, (int, np.integer)) or not 0 <= slot < self.num_slots:
            raise RunnerError(f"slot {slot!r} is out of range 0..{self.num_slots - 1}")

    def active(self, slot: int) -> SlotState:
        self.check_slot(slot)
        state = self.slots.get(slot)
        if state is None:
            raise RunnerError(f"slot {slot} holds no sequence")
        return state

    def _check_masks(self, masks: Mapping[int, np.ndarray], sampling: Sequence[int]) -> None:
        """Token masks of slots this call samples for: int32 words (at most the vocabulary's; the
        tokens past the last word are not allowed), with at least one token allowed."""
        words = (self.spec.vocab_size + 31) // 32
        for slot, mask in masks.items():
            if slot not in sampling:
                raise RunnerError(f"a token mask for slot {slot}, which samples nothing in this call")
            if mask.dtype != np.int32 or mask.ndim != 1 or not 1 <= len(mask) <= words:
                raise RunnerError(
                    f"a token mask is 1..{words} int32 words (the vocabulary's bits), "
                    f"got {mask.dtype} {mask.shape}"
                )
            if not np.unpackbits(mask.view(np.uint8), bitorder="little")[: self.spec.vocab_size].any():
                raise RunnerError(f"the token mask of slot {slot} allows no token of the vocabulary")

    def _constrain(
        self, masks: Mapping[int, np.ndarray], samplers: Mapping[int, SlotState | SlotSampler]
    ) -> None:
        self._check_masks(masks, list(samplers))
        for slot, mask in masks.items():
            holder = samplers[slot]
            sampler = holder.sampler if isinstance(holder, SlotState) else holder
            assert sampler is not None  # checked: a decode slot has finished its prompt
            sampler.constrain(mask)

    def _sampler(self, params: SamplingParams, prompt: Sequence[int]) -> SlotSampler:
        try:
            return SlotSampler(params, list(prompt), self.spec.vocab_size, self.spec.eos_ids)
        except ValueError as e:
            raise RunnerError(str(e)) from e

    def logprobs(self, slot: int) -> TokenLogprob | None:
        """The logprobs of the slot's last sampled token, if its request asked for them."""
        state = self.active(slot)
        return state.sampler.last if state.sampler is not None else None

    def recent_logprobs(self, slot: int) -> list[TokenLogprob | None]:
        """The logprobs of the tokens the slot's last verified step chose (speculative decoding),
        if its request asked for them."""
        state = self.active(slot)
        return list(state.sampler.recent) if state.sampler is not None else []

    def known_tokens(self, slot: int) -> list[int] | None:
        """The slot's tokens: those of the positions written, then its pending one (None where its
        KV came from elsewhere, or before its prompt ends)."""
        state = self.active(slot)
        if state.tokens is None or state.next_token is None or state.next_token < 0:
            return None
        return [*state.tokens, state.next_token]

    def fault(self, slot: int) -> SequenceFault | None:
        """Why the slot's last choice failed (its token is NO_TOKEN), if it did: that sequence's
        error; the slot decodes no more."""
        state = self.active(slot)
        return state.sampler.fault if state.sampler is not None else None

    def _check_tokens(self, prompt: Sequence[int]) -> np.ndarray:
        tokens = np.asarray(prompt, dtype=np.int64)
        if tokens.ndim != 1 or tokens.size == 0:
            raise RunnerError("the prompt must be a non-empty list of token ids")
        if tokens.min() < 0 or tokens.max() >= self.spec.vocab_size:
            raise RunnerError(f"token ids must lie in 0..{self.spec.vocab_size - 1}")
        return tokens

    def _sample(self, logits: Tensor, samplers: list[SlotSampler], greedy: Tensor | None = None) -> list[int]:
        """Post-process on the device: argmax when every row is plain greedy (`greedy`: the decode
        graph's own, else the argmax graph), else top-k candidates for the host-side samplers. Only
        token ids (and k candidates) leave the device, except the logits of a row whose candidates
        would be the whole vocabulary, or that needs them whole (logprobs, logit bias, min_tokens):
        that row samples from them on the host, so the batch never runs the whole-vocabulary top-k
        (agent/sampling.py)."""
        if all(s.plain_greedy for s in samplers):
            ids = (self.graphs.argmax(logits) if greedy is None else greedy).asnumpy()
            return [int(t) for t in ids[: len(samplers)]]

        def choice(sampler: SlotSampler, choose: Callable[[], int]) -> int:
            return guarded(sampler, choose, NO_TOKEN)

        vocab = self.spec.vocab_size
        whole = {
            i
            for i, s in enumerate(samplers)
            if s.needs_logits or bucket(self.topk_buckets, s.candidates_needed()) >= vocab
        }
        tokens = {}
        if whole:  # the rows come to the host: the plain greedy ones need no graph either
            whole |= {i for i, s in enumerate(samplers) if s.plain_greedy}
            rows = logits.asnumpy()
            tokens = {i: choice(samplers[i], partial(samplers[i].choose_from_logits, rows[i])) for i in whole}
        rest = [i for i in range(len(samplers)) if i not in tokens]
        if rest:
            k = bucket(self.topk_buckets, max(samplers[i].candidates_needed() for i in rest))
            values, ids = (t.asnumpy() for t in self.graphs.topk(k, logits))
            for i in rest:
                s = samplers[i]
                tokens[i] = (
                    int(ids[i, 0]) if s.plain_greedy else choice(s, partial(s.choose, values[i], ids[i]))
                )
        return [tokens[i] for i in range(len(samplers))]
