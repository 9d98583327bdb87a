"""OutputProcessor: the server's side of the engine, one async stream of text per request.

    outputs = OutputProcessor(tokenizer, metrics)
    engine = Engine(config, tokenizer.vocab_size, tokenizer.eos_ids, outputs.process, metrics)
    stream = EngineClient(engine, outputs).generate(request, stop)   # server/engine_client.py
    async for out in stream:
        out.text ...                            # pieces join to the full answer; last one: finished

The engine hands over each step's EngineOutputs (process): each request's new tokens and its end become text:
incremental UTF-8-safe detokenization, stop strings (with the text that could start one held
back), and the per-request metrics (time to first token, inter-token latency, outcome).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from agent.contract.prompt_logprobs import PromptLogprob
from agent.contract.sampling import TokenLogprob
from agent.model.detokenizer import IncrementalDetokenizer
from agent.model.tokenizer import TextTokenizer
from scheduler.engine_io import EngineOutput, FinishReason
from scheduler.timeline import Timeline
from server.errors import fault_status
from server.metrics import StreamMetrics

log = logging.getLogger(__name__)


@dataclass
class GeneratedToken:
    id: int
    logprob: TokenLogprob | None  # when the request asked for logprobs


@dataclass
class GenerationOutput:
    text: str  # new text since the previous output (may be empty)
    token_id: int | None
    index: int  # number of tokens generated so far
    finished: bool = False
    finish_reason: str | None = None
    error: str | None = None
    error_status: int = 503  # the HTTP status of `error` (server.errors.fault_status)
    tokens: list[GeneratedToken] = field(default_factory=list)  # new since the previous, as in text
    stop_string: bool = False  # finished by one of the request's stop strings
    stop_sequence: str | None = None  # which one (Anthropic's `stop_sequence`)
    # prompt positions 1.. scored (sampling's prompt_logprobs), on the output of its first token
    prompt_logprobs: tuple[PromptLogprob, ...] | None = None
    pooled: np.ndarray | None = None  # a pooling request's vector (its sampling's pool), on its last output


@dataclass
class _Stream:
    request_id: str
    queue: asyncio.Queue
    detokenizer: IncrementalDetokenizer
    stop: tuple[str, ...]
    # ids that end the answer without being part of it: EOS (unless ignore_eos), stop_token_ids
    hidden: frozenset[int]
    abort: Callable[[str], None]  # ends the request (the engine's abort)
    hold: int = 0  # characters held back: the longest stop string but one
    consumed: int = 0  # tokens of the answer received (and detokenized)
    sent: int = 0  # characters of detokenizer.text already handed out
    admitted: float = field(default_factory=time.monotonic)
    last_token: float | None = None  # when the previous token went out
    counted: bool = False  # its outcome is in the metrics
    finished: bool = False  # its last output is on the queue
    ended: bool = False  # the engine reported its end
    stop_string: bool = False  # a stop string ended it
    matched: str | None = None  # that stop string


class AnswerStream:
    """One request's outputs, as an async iterator. aclose() aborts an unfinished request and frees
    its slot, also when the stream was never iterated (a client gone before the first byte)."""

    _done = True  # until __init__ is through, __del__ has nothing to close

    def __init__(self, outputs: OutputProcessor, stream: _Stream):
        self._outputs, self._stream, self._done = outputs, stream, False
        self._loop = asyncio.get_running_loop()  # where the engine runs: the close goes there

    def __aiter__(self) -> AnswerStream:
        return self

    async def __anext__(self) -> GenerationOutput:
        if self._done:
            raise StopAsyncIteration
        output = await self._stream.queue.get()
        if output.finished:
            self._done = True
            self._outputs._close(self._stream)
        return output

    async def aclose(self) -> None:
        self._done = True
        self._outputs._close(self._stream)

    def __del__(self) -> None:
        # Safety net: a response dropped before it ever iterated (nor closed) this stream. Garbage
        # collection can run in the middle of any scheduler code (or on another thread), so the
        # close runs later on the event loop; a closed loop has no engine left to tell.
        if not self._done:
            try:
                self._loop.call_soon_threadsafe(self._outputs._close, self._stream)
            except RuntimeError:
                pass


class OutputProcessor:
    """The answer streams of one model's requests: what the engine reports of each request (its
    EngineOutputs: process, the engine's process_outputs) becomes text on that request's stream; a
    stop string found in the text is the processor's finish decision, which process returns for the
    engine to apply."""

    def __init__(
        self,
        tokenizer: TextTokenizer,
        metrics: StreamMetrics | None = None,
        on_end: Callable[[Timeline, int, str], None] | None = None,
    ):
        self.tokenizer = tokenizer
        self.metrics = metrics or StreamMetrics()
        # called once per answer the engine timed (tracing) when it is over: its timeline, its
        # token count and how it ended
        self.on_end = on_end
        self.streams: dict[str, _Stream] = {}
        self.metrics.open_streams.set_function(lambda: len(self.streams))

    def open(
        self,
        request_id: str,
        hidden: frozenset[int],
        stop: tuple[str, ...],
        abort: Callable[[str], None],
        shown: frozenset[int] = frozenset(),
    ) -> AnswerStream:
        """The stream of an admitted request; `hidden`: the ids that end it without being text (its
        EngineRequest.stop_ids); `shown`: special tokens written as text (a tool format's markers).
        Closing it early (the client is gone) calls `abort(request_id)`, which ends the request and
        frees its slot."""
        stop = tuple(s for s in stop if s)
        stream = _Stream(
            request_id,
            asyncio.Queue(),
            IncrementalDetokenizer(self.tokenizer, shown),
            stop,
            hidden,
            abort,
            hold=max((len(s) for s in stop), default=1) - 1,
        )
        self.streams[request_id] = stream
        return AnswerStream(self, stream)

    def _close(self, stream: _Stream) -> None:
        """The reader is done with the stream: an unfinished request is aborted, its slot freed."""
        if not stream.ended and not stream.stop_string:
            stream.abort(stream.request_id)  # the engine reports its end (process) before it returns
            self._count(stream, FinishReason.ABORT)
        self.streams.pop(stream.request_id, None)

    def process(self, outputs: list[EngineOutput]) -> list[str]:
        """Each request's new tokens (as text) and/or its end to its stream -> the ids of the
        requests a stop string ended (the engine then finishes them, and reports those ends)."""
        return [output.request_id for output in outputs if self._update(output)]

    def _update(self, output: EngineOutput) -> bool:
        """One request's output to its stream; whether a stop string ended it just now."""
        stream = self.streams.get(output.request_id)
        if stream is None:
            return False
        if not stream.finished:  # else a stop string ended it: only the engine's end is left
            self._show(stream, output)
        if output.finished:
            stream.ended = True
            if output.timeline is not None and self.on_end is not None:
                reason = FinishReason.STOP if stream.stop_string else output.finish_reason
                try:
                    self.on_end(output.timeline, stream.consumed, (reason or FinishReason.ABORT).value)
                except Exception:  # tracing must never fail an answer
                    log.exception("tracing request %s failed", stream.request_id)
        return stream.stop_string and not output.finished

    def _show(self, stream: _Stream, output: EngineOutput) -> None:
        new_tokens = output.new_token_ids
        stream.consumed += len(new_tokens)
        shown = []
        for i, token in enumerate(new_tokens):
            if token not in stream.hidden:  # EOS ends the answer; it is not one of its tokens
                stream.detokenizer.add(token)
                logprob = output.new_logprobs[i] if i < len(output.new_logprobs) else None
                shown.append(GeneratedToken(token, logprob))
        if output.finished:
            stream.detokenizer.flush()
        piece = self._next_piece(stream, output.finished)
        if new_tokens:
            self._time_tokens(stream, len(new_tokens))
        stream.finished = output.finished or stream.stop_string
        reason = FinishReason.STOP if stream.stop_string else output.finish_reason
        if stream.finished:
            self._count(stream, reason, output.error)
        stream.queue.put_nowait(
            GenerationOutput(
                text=piece,
                token_id=new_tokens[-1] if new_tokens else None,
                index=stream.consumed,
                finished=stream.finished,
                finish_reason=reason.value if reason else None,
                error=output.error,
                error_status=fault_status(output.fault),
                tokens=shown,
                stop_string=stream.stop_string,
                stop_sequence=stream.matched,
                prompt_logprobs=output.prompt_logprobs,
                pooled=output.pooled,
            )
        )

    def _next_piece(self, stream: _Stream, finished: bool) -> str:
        """The text not yet handed out, up to a stop string (which finishes the request)."""
        text = stream.detokenizer.text
        hits = [(i, s) for s in stream.stop if (i := text.find(s, max(0, stream.sent - len(s)))) >= 0]
        if hits:
            end, stream.matched = min(hits)
            text = text[:end]
            stream.stop_string = True
        elif stream.hold and not finished:
            # Hold back what could be the start of a stop string: once sent it cannot be taken back.
            text = text[: max(stream.sent, len(text) - stream.hold)]
        piece, stream.sent = text[stream.sent :], len(text)
        return piece

    def _time_tokens(self, stream: _Stream, count: int) -> None:
        now = time.monotonic()
        self.metrics.generated_tokens.inc(count)
        if stream.last_token is None:
            self.metrics.ttft.observe(now - stream.admitted)
        else:
            self.metrics.inter_token.observe(now - stream.last_token)
        stream.last_token = now

    def _count(self, stream: _Stream, reason: FinishReason | None, error: str | None = None) -> None:
        """A request's outcome and duration, once (`reason`: how it ended)."""
        if stream.counted:
            return
        stream.counted = True
        outcome = (
            "ok"
            if reason in (FinishReason.STOP, FinishReason.LENGTH)
            else "error"
            if reason is FinishReason.ERROR or error
            else "aborted"
        )
        self.metrics.requests.labels(outcome).inc()
        if outcome == "ok":
            self.metrics.e2e.observe(time.monotonic() - stream.admitted)
