"""A runner's slots and the host side of their token choice (ModelRunner drives the graphs).

SlotState is what a seat holds between calls, SlotTable a runner's seats. SlotSampling turns a
graph call's logits into each sequence's token: on the device where it can (argmax, top-k
candidates), on the host where a sequence needs the whole row (logprobs, logit bias, min_tokens),
verifying proposals (speculative decoding) and applying token masks (structured output). One
sequence's failed choice is its own error (its sampler's fault); the others of the step go on.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import TypeVar

import numpy as np
from mindspore import Tensor

from agent.contract.sampling import NO_TOKEN, SamplingParams, SequenceFault, TokenLogprob
from agent.contract.step import StepChunk
from agent.graphs.interface import ModelGraphs, bucket
from agent.sampling import SamplingFault, SlotSampler

log = logging.getLogger(__name__)

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


class SlotTable:
    """A runner's seats: what each holds between calls (a slot not in `slots` is free)."""

    def __init__(self, num_slots: int):
        self.num_slots = num_slots
        self.slots: dict[int, SlotState] = {}
        self.track_tokens = False  # keep each slot's token ids (a draft model follows them)

    @property
    def free_slots(self) -> list[int]:
        return [s for s in range(self.num_slots) if s not in self.slots]

    def slot_length(self, slot: int) -> int:
        return self.active(slot).length

    def release(self, slot: int) -> None:
        self.check_slot(slot)
        self.slots.pop(slot, None)

    def check_slot(self, slot: int) -> None:
        if not isinstance(slot, (int, np.integer)) or not 0 <= slot < self.num_slots:
            raise RunnerError(f"slot {slot!r} is out of range 0..{self.num_slots - 1}")

    def active(self, slot: int) -> SlotState:
        self.check_slot(slot)
        state = self.slots.get(slot)
        if state is None:
            raise RunnerError(f"slot {slot} holds no sequence")
        return state

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


class SlotSampling:
    """The token choice of one graph set's calls, over its vocabulary and EOS ids."""

    def __init__(self, graphs: ModelGraphs):
        self.graphs = graphs
        self.vocab_size, self.eos_ids = graphs.spec.vocab_size, graphs.spec.eos_ids

    def verify(
        self,
        logits: Tensor,
        greedy: Tensor,
        samplers: list[SlotSampler],
        plain: int,
        scored: list[StepChunk],
        by_slot: Mapping[int, SlotSampler | None],
    ) -> tuple[list[int], dict[int, list[int]]]:
        """A step with scored rows (after the `plain` decode rows): the plain decode rows' and the
        sampling chunks' tokens (`samplers`, chosen as sample() chooses them, from those rows alone)
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
            tokens = [int(t) for t in ids[normal]]  # as sample() chooses for plain greedy rows
        else:
            assert host is not None
            tokens = self.sample(Tensor(host[normal]), samplers, Tensor(ids[normal]))
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

    def check_masks(self, masks: Mapping[int, np.ndarray], sampling: Sequence[int]) -> None:
        """Token masks of slots this call samples for: int32 words (at most the vocabulary's; the
        tokens past the last word are not allowed), with at least one token allowed."""
        words = (self.vocab_size + 31) // 32
        for slot, mask in masks.items():
            if slot not in sampling:
                raise RunnerError(f"a token mask for slot {slot}, which samples nothing in this call")
            if mask.dtype != np.int32 or mask.ndim != 1 or not 1 <= len(mask) <= words:
                raise RunnerError(
                    f"a token mask is 1..{words} int32 words (the vocabulary's bits), "
                    f"got {mask.dtype} {mask.shape}"
                )
            if not np.unpackbits(mask.view(np.uint8), bitorder="little")[: self.vocab_size].any():
                raise RunnerError(f"the token mask of slot {slot} allows no token of the vocabulary")

    def constrain(
        self, masks: Mapping[int, np.ndarray], samplers: Mapping[int, SlotState | SlotSampler]
    ) -> None:
        self.check_masks(masks, list(samplers))
        for slot, mask in masks.items():
            holder = samplers[slot]
            sampler = holder.sampler if isinstance(holder, SlotState) else holder
            assert sampler is not None  # checked: a decode slot has finished its prompt
            sampler.constrain(mask)

    def sampler(self, params: SamplingParams, prompt: Sequence[int]) -> SlotSampler:
        try:
            return SlotSampler(params, list(prompt), self.vocab_size, self.eos_ids)
        except ValueError as e:
            raise RunnerError(str(e)) from e

    def sample(self, logits: Tensor, samplers: list[SlotSampler], greedy: Tensor | None = None) -> list[int]:
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

        vocab = self.vocab_size
        whole = {
            i
            for i, s in enumerate(samplers)
            if s.needs_logits or bucket(self.graphs.topk_buckets, s.candidates_needed()) >= vocab
        }
        tokens = {}
        if whole:  # the rows come to the host: the plain greedy ones need no graph either
            whole |= {i for i, s in enumerate(samplers) if s.plain_greedy}
            rows = logits.asnumpy()
            tokens = {i: choice(samplers[i], partial(samplers[i].choose_from_logits, rows[i])) for i in whole}
        rest = [i for i in range(len(samplers)) if i not in tokens]
        if rest:
            k = bucket(self.graphs.topk_buckets, max(samplers[i].candidates_needed() for i in rest))
            values, ids = (t.asnumpy() for t in self.graphs.topk(k, logits))
            for i in rest:
                s = samplers[i]
                tokens[i] = (
                    int(ids[i, 0]) if s.plain_greedy else choice(s, partial(s.choose, values[i], ids[i]))
                )
        return [tokens[i] for i in range(len(samplers))]
