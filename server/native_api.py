"""The MindSpore llm-serving API, byte-compatible with its clients:

    POST /models/{model}                  stream or not, per the body's "stream"
    POST /models/{model}/generate         one line {"generated_text": ...}
    POST /models/{model}/generate_stream  SSE (return_protocol "sse") or `data:` lines
    GET  /serving/get_bs[?group=N]        one SSE event: running batch size (of one group)
    GET  /serving/get_request_numbers     one SSE event: waiting requests

An SSE event's data is the JSON {"event": "message", "retry": 30000, "data": ...}, as upstream sends it.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response, StreamingResponse
from sse_starlette.sse import EventSourceResponse

from agent.contract.native_request import ClientRequest
from config.schema import ServingConfig
from server.assembly import (
    PromptEncoder,
    admit,
    check_answer_fits,
    check_served,
    sampling_params,
    served_models,
    unless_disconnected,
)
from server.errors import ApiError
from server.output import AnswerStream, OutputProcessor
from server.request_body import json_body


def sse_message(data) -> str:
    return json.dumps({"event": "message", "retry": 30000, "data": data}, ensure_ascii=False)


async def full_text(answer: AnswerStream) -> str:
    text = []
    async with contextlib.aclosing(answer):
        async for out in answer:
            if out.error:  # a failed agent or a shutdown: try again later
                raise ApiError(503, out.error)
            text.append(out.text)
    return "".join(text)


async def respond_full(http: Request, answer: AnswerStream) -> Response:
    text = await unless_disconnected(http, [answer], full_text(answer))
    if isinstance(text, Response):  # the client is gone
        return text
    return Response(
        json.dumps({"generated_text": text}, ensure_ascii=False) + "\n", media_type="application/json"
    )


async def stream_pieces(answer, return_full_text: bool, piece, error, full) -> AsyncIterator:
    """The answer's pieces in one protocol's framing: piece(text, index), error(message), full(text).
    An error is the stream's last event: the full text would read as a finished answer."""
    text = []
    async with contextlib.aclosing(answer):
        async for out in answer:
            if out.text:
                text.append(out.text)
                yield piece(out.text, len(text) - 1)
            if out.error:
                yield error(out.error)
                return
    if return_full_text:
        yield full("".join(text))


def data_line(payload: dict) -> bytes:
    return ("data:" + json.dumps(payload, ensure_ascii=False) + "\n").encode()


def sse_events(answer, return_full_text: bool) -> AsyncIterator[str]:
    return stream_pieces(
        answer,
        return_full_text,
        lambda text, _i: sse_message(text),
        lambda message: json.dumps({"event": "error", "retry": 30000, "data": message}),
        sse_message,
    )


def data_lines(answer, return_full_text: bool) -> AsyncIterator[bytes]:
    return stream_pieces(
        answer,
        return_full_text,
        lambda text, i: data_line({"token": {"text": text, "index": i}}),
        lambda message: data_line({"error": message}),
        lambda text: data_line({"generated_text": text}),
    )


def respond_stream(answer, request: ClientRequest):
    p = request.parameters
    if p.return_protocol == "sse":
        return EventSourceResponse(sse_events(answer, p.return_full_text))
    return StreamingResponse(data_lines(answer, p.return_full_text), media_type="text/plain")


async def one_event(value: int):
    yield sse_message(value)


def native_router(config: ServingConfig, outputs: OutputProcessor, encoder: PromptEncoder) -> APIRouter:
    router = APIRouter()
    engine = outputs.engine
    client_request = json_body(ClientRequest)
    served = served_models(config)

    async def start(model: str, request: ClientRequest) -> AnswerStream:
        check_served(model, served)
        p = request.parameters
        chat = config.server.apply_chat_template if p.chat_template is None else p.chat_template
        bounded = p.truncate is None  # else cut to its last tokens: any length may fit
        prompt = await (
            encoder.encode_chat([{"role": "user", "content": request.inputs}], bounded)
            if chat
            else encoder.encode(request.inputs, bounded)
        )
        if p.truncate is not None:
            prompt = prompt[-p.truncate :]
        if "max_new_tokens" in p.model_fields_set:  # the upstream default (300) still just ends early
            check_answer_fits(
                len(prompt), p.max_new_tokens, outputs.engine.max_seq_len, False, "max_new_tokens"
            )
        sampling = sampling_params(p, p.do_sample, p.seed)
        [stream] = await admit(
            outputs, prompt, [sampling], p.max_new_tokens, p.stop, p.ignore_eos, openai=False
        )
        return stream

    @router.post("/models/{model}")
    async def generate_any(http: Request, model: str, request: ClientRequest = Depends(client_request)):
        answer = await start(model, request)
        return respond_stream(answer, request) if request.stream else await respond_full(http, answer)

    @router.post("/models/{model}/generate")
    async def generate(http: Request, model: str, request: ClientRequest = Depends(client_request)):
        return await respond_full(http, await start(model, request))

    @router.post("/models/{model}/generate_stream")
    async def generate_stream(model: str, request: ClientRequest = Depends(client_request)):
        return respond_stream(await start(model, request), request)

    @router.get("/serving/get_bs")
    async def get_bs(group: int | None = None):
        """?group=N: that replica's batch (group N is the agent of port N in agents.ports)."""
        if group is not None and not 0 <= group < len(engine.clients):
            raise ApiError(400, f"group {group} does not exist (groups: 0..{len(engine.clients) - 1})")
        return EventSourceResponse(one_event(engine.get_bs_current(group)))

    @router.get("/serving/get_request_numbers")
    async def get_request_numbers():
        return EventSourceResponse(one_event(engine.get_queue_current()))

    return router
