"""A sequence's timeline: when it was admitted, each agent call it took part in (the prompt chunks
it computed, the decode steps), its first token and its end, as the engine measures them. Kept
only while tracing is on (server.otlp_endpoint: the engine's `timed`); server/tracing.py turns it
into spans. The engine knows nothing of tracing beyond this."""

from __future__ import annotations

from dataclasses import dataclass, field

MAX_DECODE_CALLS = 256  # decode calls kept per sequence (a long answer's later ones are counted only)


@dataclass(frozen=True)
class AgentCall:
    op: str  # what the step ran (StepRequest.kind: decode, prefill, mixed) or prefill_and_send (PD)
    agent: str  # the agent's address (a group's first)
    start: float  # time.monotonic()
    end: float
    chunk: tuple[int, int] | None = None  # the prompt positions [start, end) it computed for the sequence


@dataclass
class Timeline:
    admitted: float  # time.monotonic()
    calls: list[AgentCall] = field(default_factory=list)
    first_token: float | None = None
    finished: float | None = None
    dropped: int = 0  # decode calls past MAX_DECODE_CALLS
    context: object = None  # the request's trace (its EngineRequest.trace), opaque here

    def called(self, call: AgentCall) -> None:
        if call.chunk is None and len(self.calls) >= MAX_DECODE_CALLS:
            self.dropped += 1
        else:
            self.calls.append(call)
