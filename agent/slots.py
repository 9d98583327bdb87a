"""A runner's slots: SlotState is what a slot holds between calls, SlotTable a runner's slots and
what a step's tokens carry from them (their logprobs, the sequence's fault). ModelRunner
(agent/runner.py) holds one; its token choice is agent/token_chooser.py's.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np

from agent.contract.sampling import Sampled, SequenceFault, TokenLogprob
from agent.sampling import SlotSampler

log = logging.getLogger(__name__)


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
    # rows of its last step whose Gated DeltaNet state was held (proposals being verified) and which
    # it kept: its next step replays them onto the state first (agent/kernels/gated_delta.h)
    replay: int = 0


class SlotTable:
    """A runner's slots: what each holds between calls (a slot not in `slots` is free)."""

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

    def sampled(self, slot: int, tokens: list[int]) -> list[Sampled]:
        """The slot's tokens of a step with their logprobs (where its request asked for them) and
        its fault (where its choice failed): one entry each, whatever the request asked, so the
        server pairs them with the tokens."""
        paired, fault = self._token_logprobs(slot, len(tokens)), self.fault(slot)
        if paired is None:  # a bug of this slot's: its sequence's error, not the whole reply's
            paired = [None] * len(tokens)
            fault = SequenceFault("internal", "its tokens' logprobs were lost (see the agent's log)")
        return [Sampled(token, logprob, fault) for token, logprob in zip(tokens, paired)]

    def _token_logprobs(self, slot: int, count: int) -> list[TokenLogprob | None] | None:
        """The logprobs of the slot's `count` tokens of a step (nulls where its request asked
        none), or None, logged, where they do not pair with its tokens."""
        if count == 1:
            return [self.logprobs(slot)]
        recent = self.recent_logprobs(slot)
        if not recent:  # its request asked for no logprobs
            return [None] * count
        if len(recent) != count:
            log.error(
                "slot %d: %d logprobs for %d verified tokens; its sequence fails", slot, len(recent), count
            )
            return None
        return recent

    def computed(self, slot: int, ids: np.ndarray, table: np.ndarray) -> SlotState:
        """The slot (taken if free) holds positions 0..len(ids)-1, the KV of `ids`, in the blocks
        of `table`."""
        end = len(ids)
        state = self.slots.get(slot)
        if state is None:
            state = self.slots[slot] = SlotState(length=end, table=table)
        state.length, state.table = end, table
        state.tokens = ids.tolist() if self.track_tokens else None
        state.replay = 0  # a chunk rebuilt its state (from position 0 or a snapshot): nothing held applies
        return state

    @staticmethod
    def decoded(states: list[SlotState], tables: list[np.ndarray], tokens: list[list[int]]) -> None:
        """Each slot wrote its pending token (and the proposals kept after it): `tokens`, each
        slot's tokens of the step, the last one pending now."""
        for state, table, chosen in zip(states, tables, tokens):
            state.table = table
            state.length += len(chosen)
            if state.tokens is not None and state.next_token is not None:
                state.tokens += [state.next_token, *chosen[:-1]]
            state.next_token = chosen[-1]
