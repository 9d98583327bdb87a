"""Sequence: one request's prompt, parameters, generated ids and place in the batch: the scheduler's
mutable state, which never leaves the engine (scheduler/engine_io.py is what does)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import numpy as np

from agent.contract.prompt_logprobs import PromptLogprob
from agent.contract.sampling import SamplingParams, TokenLogprob
from scheduler.engine_io import EngineOutput, EngineRequest, FaultKind, FinishReason, TokenConstraint
from scheduler.speculation.ngram import SpeculationState
from scheduler.timeline import Timeline


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Sequence:
    request_id: str
    prompt: list[int]
    sampling: SamplingParams
    max_new_tokens: int
    stop_ids: frozenset[int] = frozenset()
    output: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)  # one per output token, when asked for
    # sampling.prompt_logprobs: prompt positions 1.. scored so far (entry i: position i + 1)
    prompt_logprobs: list[PromptLogprob] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    group: int | None = None
    slot: int | None = None
    finish_reason: FinishReason | None = None
    error: str | None = None
    fault: FaultKind = FaultKind.UNAVAILABLE  # what kind of error `error` is, when it has one
    reported: int = 0  # output tokens already handed to the front end (in EngineOutputs)
    end_reported: bool = False  # its finished EngineOutput went out (once only)
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
    # At its last preemption, the positions its agent slot holds: its recompute starts no later
    # (the slot refuses a chunk past them)
    slot_holds: int = 0
    # Gated DeltaNet layers: the state snapshot its prefix-cache hit starts from (until the chunk
    # that restores it ran), and the positions whose state its chunks save (scheduler/state_snapshots.py)
    state_restore: int | None = None
    state_saves: list[int] = field(default_factory=list)
    constraint: TokenConstraint | None = None  # structured output: the grammar it follows
    pooled: np.ndarray | None = None  # a pooling request's vector (its sampling's pool), once computed
    cache_salt: str | None = None  # its prefix-cache blocks are shared only with this salt's
    client: str = ""  # who asked (an API key's digest, or an address): fairness between clients
    priority: int = 0  # lower first, with scheduling_policy priority (vLLM's)
    speculate: bool = True  # the request lets the scheduler propose its tokens (speculative decoding)
    speculation: SpeculationState | None = None  # its proposals' state, once it proposed
    timeline: Timeline | None = None  # its agent calls' times, while tracing is on (scheduler/timeline.py)

    @classmethod
    def from_request(
        cls, request: EngineRequest, stop_ids: frozenset[int], timeline: Timeline | None = None
    ) -> Sequence:
        """A request's sequence, waiting; `stop_ids`: the ids that end it (EngineRequest.stop_ids of
        the model's EOS ids); `timeline`: its times, while tracing is on."""
        return cls(
            request.request_id,
            list(request.prompt),
            request.sampling,
            request.max_new_tokens,
            stop_ids,
            constraint=request.constraint,
            cache_salt=request.cache_salt,
            client=request.client,
            priority=request.priority,
            speculate=request.speculate,
            timeline=timeline,
        )

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

    @property
    def scoring_prompt(self) -> bool:
        """It asked for prompt logprobs and some are missing: its prompt is computed from position 0
        (no prefix-cache hit) in prefill steps of its own (StepChunk.prompt_logprobs)."""
        return self.sampling.prompt_logprobs is not None and len(self.prompt_logprobs) < len(self.prompt) - 1

    def tokens(self, upto: int) -> list[int]:
        """The first `upto` token ids of prompt + output."""
        if upto <= len(self.prompt):
            return self.prompt[:upto]
        return self.prompt + self.output[: upto - len(self.prompt)]

    def report(self) -> EngineOutput | None:
        """What the front end has not seen yet: the tokens since the last report and, once it is
        over, how it ended (its timeline with it); None when there is nothing new (a chunk that
        samples nothing), and once its end was reported (a request aborted while its step was in
        flight is touched again by the step)."""
        if self.end_reported or (len(self.output) == self.reported and not self.finished):
            return None
        first, self.reported, self.end_reported = self.reported, len(self.output), self.finished
        asked = self.sampling.prompt_logprobs is not None and first == 0 and self.reported > 0
        return EngineOutput(
            self.request_id,
            tuple(self.output[first:]),
            tuple(self.logprobs[first : self.reported]),
            self.finish_reason,
            self.error,
            self.fault if self.error is not None else None,
            self.timeline if self.finished else None,
            tuple(self.prompt_logprobs) if asked else None,
            self.pooled if self.finished else None,
        )
