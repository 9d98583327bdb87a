"""Sequence: one request's prompt, parameters, generated ids and place in the batch."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from agent.contract.sampling import SamplingParams, TokenLogprob
from scheduler.ngram import SpeculationState
from scheduler.timeline import Timeline


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"  # an EOS id or a stop string
    LENGTH = "length"  # max_new_tokens or the slot's last position
    ABORT = "abort"  # the client went away or asked to stop
    ERROR = "error"  # its group failed, or its own choice did (Sequence.error says which)


class TokenConstraint(Protocol):
    """Which tokens a sequence may generate next (structured output: server/structured_output.py
    holds the grammar); the engine sends its mask with every call that samples for the sequence."""

    def mask(self) -> np.ndarray:
        """The tokens allowed next: int32 words, bit j of word i for token 32 i + j."""
        ...

    def advance(self, token: int) -> None:
        """The token chosen; ValueError if the grammar did not allow it."""
        ...

    @property
    def complete(self) -> bool:
        """The grammar is satisfied and allows nothing more (but EOS)."""
        ...


@dataclass
class Sequence:
    request_id: str
    prompt: list[int]
    sampling: SamplingParams
    max_new_tokens: int
    stop_ids: frozenset[int] = frozenset()
    output: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)  # one per output token, when asked for
    status: SequenceStatus = SequenceStatus.WAITING
    group: int | None = None
    slot: int | None = None
    finish_reason: FinishReason | None = None
    error: str | None = None
    # The HTTP status its error maps to: 503 when its group failed (try again), 400 when its own
    # parameters left nothing to sample, 500 when its own value could not be computed.
    error_status: int = 503
    token_budget: int = 0  # prompt + answer tokens counted against the in-flight bound
    # PD disaggregation: where the prompt is prefilled and the ticket of its KV transfer
    prefill_group: int | None = None
    prefill_slot: int | None = None
    ticket: int | None = None
    transferring: bool = False  # until the decode group holds its KV
    # Paged KV: positions whose KV its group holds (0 again after a preemption) and how often it
    # was preempted (its blocks taken for others; it is recomputed, the prefix cache helping)
    computed: int = 0
    preemptions: int = 0
    constraint: TokenConstraint | None = None  # structured output: the grammar it follows
    cache_salt: str | None = None  # its prefix-cache blocks are shared only with this salt's
    client: str = ""  # who asked (an API key's digest, or an address): fairness between clients
    priority: int = 0  # lower first, with scheduling_policy priority (vLLM's)
    speculate: bool = True  # the request lets the scheduler propose its tokens (speculative decoding)
    speculation: SpeculationState | None = None  # its proposals' state, once it proposed
    timeline: Timeline | None = None  # its agent calls' times, while tracing is on (scheduler/timeline.py)

    @property
    def finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def placement(self) -> tuple[int, int]:
        """(group, slot) of a sequence the scheduler placed: every running sequence, and every
        finished one that ran."""
        assert self.group is not None and self.slot is not None, f"{self.request_id} was never placed"
        return self.group, self.slot

    @property
    def prefill_placement(self) -> tuple[int, int]:
        """(prefill group, prefill slot) of a placed sequence whose prompt is prefilled elsewhere
        (PD disaggregation), until its KV transfer is over."""
        assert self.prefill_group is not None and self.prefill_slot is not None, (
            f"{self.request_id} has no prefill slot"
        )
        return self.prefill_group, self.prefill_slot

    @property
    def positions_used(self) -> int:
        """KV positions a decode needs written: the prompt and every output token but the last
        (still pending: the next decode writes it)."""
        return len(self.prompt) + max(0, len(self.output) - 1)

    @property
    def positions_left(self) -> int:
        """Positions still to compute before it can decode."""
        return self.positions_used - self.computed

    @property
    def needs_prefill(self) -> bool:
        """Positions are missing: a prompt not yet (wholly) computed, or a preempted sequence."""
        return self.computed < self.positions_used

    def tokens(self, upto: int) -> list[int]:
        """The first `upto` token ids of prompt + output."""
        if upto <= len(self.prompt):
            return self.prompt[:upto]
        return self.prompt + self.output[: upto - len(self.prompt)]
