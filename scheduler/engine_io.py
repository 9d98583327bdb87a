"""The engine's boundary, as vLLM's EngineCoreRequest and EngineCoreOutput: a front end hands the
engine a frozen EngineRequest (Engine.add_request) and reads frozen EngineOutputs (the engine's
process_outputs), never the scheduler's mutable Sequence.

    engine.add_request(EngineRequest(request_id="r1", prompt=prompt, sampling=sampling, max_new_tokens=64))
    ... process_outputs([EngineOutput("r1", new_token_ids=(42,), ...), ...]) after each step ...
    ... and exactly one finished output (finish_reason set) per request, whatever ended it ...

A request refused at once raises AdmissionError with its Refusal. A fault is named by its kind
(FaultKind); what a refusal or a kind means to an HTTP client (its status) is the server's to say
(server/errors.py).
"""

from __future__ import annotations

import enum
from collections.abc import Set
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import numpy as np

from agent.contract.prompt_logprobs import PromptLogprob
from agent.contract.sampling import SamplingParams, TokenLogprob

if TYPE_CHECKING:
    from scheduler.timeline import Timeline


class Refusal(str, enum.Enum):
    """Why a request is refused at once; the server turns it into a status (server/errors.py)."""

    EMPTY_PROMPT = "empty_prompt"
    TOO_LONG = "too_long"  # the prompt is longer than any group accepts
    OVERLOADED = "overloaded"  # no room now (queue or tokens in flight): worth retrying soon
    CLIENT_LIMIT = "client_limit"  # the server is full and this client holds more than its share
    NO_GROUP = "no_group"  # every group failed; waiting for one to come back
    NOT_READY = "not_ready"  # the engine has not connected to its groups yet
    SHUTTING_DOWN = "shutting_down"


class AdmissionError(Exception):
    """A request refused at once, with the reason."""

    def __init__(self, message: str, reason: Refusal):
        super().__init__(message)
        self.reason = reason


class FinishReason(str, enum.Enum):
    STOP = "stop"  # an EOS id or a stop string
    LENGTH = "length"  # max_new_tokens or the slot's last position
    ABORT = "abort"  # the client went away or asked to stop
    ERROR = "error"  # its group failed, or its own choice did (the output's fault says which)


class FaultKind(str, enum.Enum):
    """Why a request ended with an error. "request" and "internal" are the agent's own kinds
    (agent.contract.sampling.SequenceFault); the others are the engine's."""

    UNAVAILABLE = "unavailable"  # its group failed, or the engine stopped: worth trying again
    REQUEST = "request"  # its own parameters left nothing to sample
    INTERNAL = "internal"  # a value of its own could not be computed (a bug)


class TokenConstraint(Protocol):
    """Which tokens a sequence may generate next (structured output: server/structured_output.py
    holds the grammar; a thinking budget: server/thinking_budget.py); the engine sends its mask
    with every call that samples for the sequence."""

    def mask(self) -> np.ndarray | None:
        """The tokens allowed next: int32 words, bit j of word i for token 32 i + j; None: any."""
        ...

    @property
    def free_tokens(self) -> int | None:
        """How many next tokens may be any (proposed, speculative decoding); None: all of them."""
        ...

    def advance(self, token: int) -> None:
        """The token chosen; ValueError if the grammar did not allow it."""
        ...

    @property
    def complete(self) -> bool:
        """The grammar is satisfied and allows nothing more (but EOS)."""
        ...


@dataclass(frozen=True, kw_only=True)
class EngineRequest:
    """One answer to generate. `sampling` is the value validated where the request entered (the
    API's schema built it); the engine and the agents take it as it is. `constraint`: the grammar
    its tokens follow; `cache_salt`: its prompt shares prefix-cache blocks only with requests of the
    same salt; `client`: who asked (the scheduler shares the server fairly between clients);
    `priority`: lower first (with scheduling_policy priority); `speculate`: false opts out of
    speculative decoding; `trace`: the server's tracing context, carried opaquely on its Timeline."""

    request_id: str
    prompt: tuple[int, ...]
    sampling: SamplingParams
    max_new_tokens: int
    ignore_eos: bool = False
    constraint: TokenConstraint | None = None
    cache_salt: str | None = None
    client: str = ""
    priority: int = 0
    speculate: bool = True
    trace: object = None

    def __post_init__(self) -> None:
        if not isinstance(self.sampling, SamplingParams):
            raise TypeError(f"sampling must be a SamplingParams, not {type(self.sampling).__name__}")
        if self.max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {self.max_new_tokens}")
        object.__setattr__(self, "prompt", tuple(self.prompt))

    def stop_ids(self, eos_ids: Set[int]) -> frozenset[int]:
        """The ids that end its answer without being part of it: EOS (unless ignore_eos) and its
        stop_token_ids. The scheduler stops on them; the server hides them from the text."""
        eos = frozenset() if self.ignore_eos else frozenset(eos_ids)
        return eos | frozenset(self.sampling.stop_token_ids)


@dataclass(frozen=True)
class EngineOutput:
    """What one step (or the request's end) added to one request: its new tokens, their logprobs
    (one per token, when it asked for them), and once it is over why (`finish_reason`), with the
    error and its kind when it failed. `prompt_logprobs` (its sampling's prompt_logprobs): prompt
    positions 1.. scored (agent/contract/prompt_logprobs.py), once, with its first token.
    `timeline` (tracing on, finished outputs only): the engine's record of its agent calls,
    complete by then."""

    request_id: str
    new_token_ids: tuple[int, ...] = ()
    new_logprobs: tuple[TokenLogprob, ...] = ()
    finish_reason: FinishReason | None = None
    error: str | None = None
    fault: FaultKind | None = None
    timeline: Timeline | None = None
    prompt_logprobs: tuple[PromptLogprob, ...] | None = None
    pooled: np.ndarray | None = None  # a pooling request's vector (its sampling's pool), when finished

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
