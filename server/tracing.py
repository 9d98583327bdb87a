"""OpenTelemetry tracing of requests (opt-in: `server.otlp_endpoint`), exported over OTLP/gRPC.

Each HTTP request (and gRPC inference request: `traced`) gets a SERVER span, a child of the
client's W3C `traceparent` when it sends one, named as the GenAI semantic conventions name an
inference span (`chat tiny`, `text_completion tiny`, `generate tiny`) once its model is known, with
their attributes (gen_ai.operation.name, gen_ai.request.model and sampling parameters,
gen_ai.usage.input_tokens / output_tokens, gen_ai.response.finish_reasons,
gen_ai.server.time_to_first_token). Under it, per answer, from the Timeline the engine kept of it
(scheduler/timeline.py) and hands over with its end:

    queue                      admitted -> its first prompt chunk starts
    prefill                    the prompt's chunks, each a child span `prefill chunk` (one agent call:
                               its agent, op and positions)
    decode                     first token -> end, each decode call a child span `agent step`

This module imports OpenTelemetry's SDK only when a Tracing is built (server.otlp_endpoint is set):
with tracing off none of it is loaded and the engine keeps no timelines.
"""

from __future__ import annotations

import contextlib
import contextvars
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from config.schema import ServerSection
from scheduler.engine_io import EngineRequest
from scheduler.timeline import Timeline

if TYPE_CHECKING:
    from opentelemetry.trace import Span

EXPORT_DELAY_MS = 500  # spans leave in batches at most this late
SPAN_METHODS = {"GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS", "gRPC"}
MAX_PATH_CHARS = 256  # of url.path on a span
OPERATIONS = {  # gen_ai.operation.name by route
    "/v1/chat/completions": "chat",
    "/v1/responses": "chat",
    "/v1/messages": "chat",
    "/v1/completions": "text_completion",
}


class RequestTrace:
    """One request's span and what its answers add to it."""

    def __init__(self, span: Span, operation: str):
        self.span, self.operation = span, operation
        self.output_tokens = 0
        self.reasons: list[str] = []

    def admitted(self, model: str, request: EngineRequest) -> None:
        """The request reached a model's engine: the span is named and attributed for it."""
        s = request.sampling
        self.span.update_name(f"{self.operation} {model}")
        self.span.set_attributes(
            {
                "gen_ai.operation.name": self.operation,
                "gen_ai.provider.name": "ms-llm-serving",
                "gen_ai.request.model": model,
                "gen_ai.response.model": model,
                "gen_ai.request.max_tokens": request.max_new_tokens,
                "gen_ai.request.temperature": s.temperature if s.do_sample else 0.0,
                "gen_ai.request.top_p": s.top_p,
                "gen_ai.request.top_k": s.top_k,
                "gen_ai.usage.input_tokens": len(request.prompt),
                "gen_ai.response.id": request.request_id,
            }
        )


CURRENT: contextvars.ContextVar[RequestTrace | None] = contextvars.ContextVar("request_trace", default=None)


def current_request() -> RequestTrace | None:
    """The trace of the request this task serves (None: tracing is off, or outside a request)."""
    return CURRENT.get()


class Tracing:
    def __init__(self, server: ServerSection, service: str = "ms-llm-serving"):
        try:
            from opentelemetry import trace
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
            from opentelemetry.sdk.resources import Resource
            from opentelemetry.sdk.trace import TracerProvider
            from opentelemetry.sdk.trace.export import BatchSpanProcessor
            from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
        except ImportError as exc:
            raise ValueError(
                f"server.otlp_endpoint needs OpenTelemetry's SDK and OTLP exporter ({exc}): "
                "pip install -e '.[tracing]' (make setup-dev installs it)"
            ) from exc

        endpoint = server.otlp_endpoint or ""
        self.provider = TracerProvider(resource=Resource.create({"service.name": service}))
        exporter = OTLPSpanExporter(endpoint=endpoint, insecure=not endpoint.startswith("https://"))
        self.provider.add_span_processor(BatchSpanProcessor(exporter, schedule_delay_millis=EXPORT_DELAY_MS))
        self.tracer = self.provider.get_tracer("ms-llm-serving")
        self.trace, self.propagator = trace, TraceContextTextMapPropagator()
        self.server_kind = trace.SpanKind.SERVER
        # time.monotonic() -> epoch nanoseconds (the timelines are monotonic, spans are epoch)
        self.epoch_offset_ns = time.time_ns() - time.monotonic_ns()

    def ns(self, monotonic_s: float) -> int:
        return int(monotonic_s * 1e9) + self.epoch_offset_ns

    def start_request(self, method: str, path: str, headers: dict[str, str]) -> RequestTrace:
        """The request's span, a child of the client's traceparent if it sends one. Named by its
        method alone until its model is known: a path is the client's to choose."""
        parent = self.propagator.extract(headers)
        method = method if method in SPAN_METHODS else "_OTHER"  # as OpenTelemetry's conventions say
        span = self.tracer.start_span(
            method,
            context=parent,
            kind=self.server_kind,
            attributes={"http.request.method": method, "url.path": path[:MAX_PATH_CHARS]},
        )
        return RequestTrace(span, OPERATIONS.get(path, "generate"))

    def answer_ended(self, timeline: Timeline, output_tokens: int, finish_reason: str) -> None:
        """An answer is over (finished or aborted): its timeline's spans under its request's span
        (its EngineRequest's trace, which the timeline carries)."""
        request = timeline.context
        if not isinstance(request, RequestTrace):
            return
        end = timeline.finished or time.monotonic()
        parent = self.trace.set_span_in_context(request.span)
        chunks = [c for c in timeline.calls if c.chunk is not None]
        decodes = [c for c in timeline.calls if c.chunk is None]
        started = chunks[0].start if chunks else end
        self._span("queue", parent, timeline.admitted, started, {})
        if chunks:
            prefill = self._start("prefill", parent, chunks[0].start, {"llm_serving.chunks": len(chunks)})
            inner = self.trace.set_span_in_context(prefill)
            for call in chunks:
                assert call.chunk is not None
                attributes = {
                    "llm_serving.agent": call.agent,
                    "llm_serving.op": call.op,
                    "llm_serving.positions.start": call.chunk[0],
                    "llm_serving.positions.end": call.chunk[1],
                }
                self._span("prefill chunk", inner, call.start, call.end, attributes)
            prefill.end(self.ns(chunks[-1].end))
        if timeline.first_token is not None:
            attributes = {
                "gen_ai.usage.output_tokens": output_tokens,
                "llm_serving.calls_dropped": timeline.dropped,
            }
            decode = self._start("decode", parent, timeline.first_token, attributes)
            inner = self.trace.set_span_in_context(decode)
            for call in decodes:
                self._span(
                    "agent step",
                    inner,
                    call.start,
                    call.end,
                    {"llm_serving.agent": call.agent, "llm_serving.op": call.op},
                )
            decode.end(self.ns(end))
            request.span.set_attribute(
                "gen_ai.server.time_to_first_token", timeline.first_token - timeline.admitted
            )
        request.output_tokens += output_tokens
        request.reasons.append(finish_reason)
        request.span.set_attributes(
            {
                "gen_ai.usage.output_tokens": request.output_tokens,
                "gen_ai.response.finish_reasons": request.reasons,
            }
        )

    def _start(self, name: str, parent: Any, start: float, attributes: dict) -> Span:
        return self.tracer.start_span(name, context=parent, start_time=self.ns(start), attributes=attributes)

    def _span(self, name: str, parent: Any, start: float, end: float, attributes: dict) -> None:
        self._start(name, parent, start, attributes).end(self.ns(end))

    def shutdown(self) -> None:
        """Export what is left."""
        self.provider.shutdown()


@contextlib.contextmanager
def traced(tracing: Tracing | None, method: str, path: str, headers: dict[str, str]) -> Iterator[None]:
    """A request served outside HTTP (gRPC) traced as TracingMiddleware traces HTTP's; nothing
    when tracing is off."""
    if tracing is None:
        yield
        return
    trace = tracing.start_request(method, path, headers)
    token = CURRENT.set(trace)
    try:
        yield
    except BaseException:
        trace.span.set_status(tracing.trace.StatusCode.ERROR)
        raise
    finally:
        CURRENT.reset(token)
        trace.span.end()


class TracingMiddleware:
    """Plain ASGI middleware (it must not buffer streams): the request's span around everything,
    current (CURRENT) while the request is served, ended with the response's status."""

    def __init__(self, app, tracing: Tracing):
        self.app, self.tracing = app, tracing

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
        trace = self.tracing.start_request(scope["method"], scope["path"], headers)
        token = CURRENT.set(trace)
        status = 500

        async def sending(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, sending)
        finally:
            CURRENT.reset(token)
            trace.span.set_attribute("http.response.status_code", status)
            if status >= 500:
                trace.span.set_status(self.tracing.trace.StatusCode.ERROR)
            trace.span.end()
