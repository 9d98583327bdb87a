"""The HTTP front end: the MindSpore llm-serving API, byte-compatible with its clients.

    POST /models/{model}                  stream or not, per the body's "stream"
    POST /models/{model}/generate         one line {"generated_text": ...}
    POST /models/{model}/generate_stream  SSE (return_protocol "sse") or `data:` lines
    GET  /serving/get_bs[?group=N]        one SSE event: running batch size (of one group)
    GET  /serving/get_request_numbers     one SSE event: waiting requests

An SSE event's data is the JSON {"event": "message", "retry": 30000, "data": ...}, as upstream sends it.
Errors are JSON {"error": message} with a status that says what happened.
"""
from __future__ import annotations

import contextlib
import json
import uuid
from typing import AsyncIterator

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import Response, StreamingResponse
from sse_starlette.sse import EventSourceResponse
from starlette.exceptions import HTTPException

from agent.contract.sampling import SamplingParams
from agent.contract.native_request import ClientRequest
from config.schema import ServingConfig
from scheduler.batch_scheduler import AdmissionError
from server.access import AccessMiddleware
from server.errors import ApiError, error_response
from server.llm_server import AnswerStream, LLMServer
from server.openai_api import openai_router
from server.ops_api import ops_router
from server.request_body import json_body
from agent.model.tokenizer import TextTokenizer, TokenizerError

def sse_message(data) -> str:
    return json.dumps({"event": "message", "retry": 30000, "data": data}, ensure_ascii=False)


def create_app(config: ServingConfig, tokenizer: TextTokenizer, llm_server: LLMServer) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI):
        await llm_server.start()
        yield
        await llm_server.stop()

    app = FastAPI(title="ms-llm-serving", lifespan=lifespan)
    client_request = json_body(ClientRequest)
    served = [config.model.name, *config.model.aliases]

    def is_openai(request: Request) -> bool:
        return request.url.path.startswith("/v1/")

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError):
        return error_response(exc.status, exc.message, is_openai(request), exc.param, exc.code)

    @app.exception_handler(HTTPException)
    async def _http_error(request: Request, exc: HTTPException):
        # Unknown paths and wrong methods answer in the same JSON shape as every other error.
        return error_response(exc.status_code, str(exc.detail), is_openai(request), headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError):
        errors = exc.errors()
        if any(e.get("type") == "json_invalid" for e in errors):
            return error_response(400, "the request body is not valid JSON", is_openai(request))
        fields = ['.'.join(str(p) for p in e['loc'] if p != 'body') or 'body' for e in errors]
        problems = "; ".join(f"{field}: {e['msg']}" for field, e in zip(fields, errors))
        # OpenAI's clients expect 400 for a bad parameter; the native API says 422.
        return error_response(400 if is_openai(request) else 422, problems, is_openai(request),
                              param=fields[0])

    app.include_router(openai_router(config, tokenizer, llm_server))
    app.include_router(ops_router(config, llm_server))
    app.add_middleware(AccessMiddleware, api_keys=config.server.api_keys,
                       max_body_bytes=config.server.max_body_bytes)
    if config.server.cors_origins:
        app.add_middleware(CORSMiddleware, allow_origins=config.server.cors_origins,
                           allow_methods=["GET", "POST"], allow_headers=["Authorization", "Content-Type"])

    def start(model: str, request: ClientRequest) -> AnswerStream:
        if model not in served:
            raise ApiError(404, f"model {model!r} is not served here; served: {', '.join(served)}")
        p = request.parameters
        chat = config.server.apply_chat_template if p.chat_template is None else p.chat_template
        try:
            prompt = (tokenizer.encode_chat([{"role": "user", "content": request.inputs}]) if chat
                      else tokenizer.encode(request.inputs))
        except TokenizerError as exc:
            raise ApiError(400, str(exc)) from exc
        if p.truncate is not None:
            prompt = prompt[-p.truncate:]
        sampling = SamplingParams(do_sample=p.do_sample, temperature=p.temperature, top_k=p.top_k,
                                  top_p=p.top_p, repetition_penalty=p.repetition_penalty, seed=p.seed)
        try:
            return llm_server.generate_answer(uuid.uuid4().hex, prompt, sampling, p.max_new_tokens,
                                              tuple(p.stop), p.ignore_eos)
        except AdmissionError as exc:
            raise ApiError(exc.status, str(exc)) from exc

    async def full_text(outputs: AnswerStream) -> str:
        text = []
        async with contextlib.aclosing(outputs):
            async for out in outputs:
                if out.error:  # a failed agent or a shutdown: try again later
                    raise ApiError(503, out.error)
                text.append(out.text)
        return "".join(text)

    async def respond_full(outputs) -> Response:
        body = json.dumps({"generated_text": await full_text(outputs)}, ensure_ascii=False) + "\n"
        return Response(body, media_type="application/json")

    async def stream_pieces(outputs, return_full_text: bool, piece, error, full) -> AsyncIterator:
        """The answer's pieces in one protocol's framing: piece(text, index), error(message), full(text)."""
        text = []
        async with contextlib.aclosing(outputs):
            async for out in outputs:
                if out.text:
                    text.append(out.text)
                    yield piece(out.text, len(text) - 1)
                if out.error:
                    yield error(out.error)
        if return_full_text:
            yield full("".join(text))

    def data_line(payload: dict) -> bytes:
        return ("data:" + json.dumps(payload, ensure_ascii=False) + "\n").encode()

    def sse_events(outputs, return_full_text: bool) -> AsyncIterator[str]:
        return stream_pieces(outputs, return_full_text, lambda text, _i: sse_message(text),
                             lambda message: json.dumps({"event": "error", "retry": 30000, "data": message}),
                             sse_message)

    def data_lines(outputs, return_full_text: bool) -> AsyncIterator[bytes]:
        return stream_pieces(outputs, return_full_text,
                             lambda text, i: data_line({"token": {"text": text, "index": i}}),
                             lambda message: data_line({"error": message}),
                             lambda text: data_line({"generated_text": text}))

    def respond_stream(outputs, request: ClientRequest):
        p = request.parameters
        if p.return_protocol == "sse":
            return EventSourceResponse(sse_events(outputs, p.return_full_text))
        return StreamingResponse(data_lines(outputs, p.return_full_text), media_type="text/plain")

    @app.post("/models/{model}")
    async def generate_any(model: str, request: ClientRequest = Depends(client_request)):
        outputs = start(model, request)
        return respond_stream(outputs, request) if request.stream else await respond_full(outputs)

    @app.post("/models/{model}/generate")
    async def generate(model: str, request: ClientRequest = Depends(client_request)):
        return await respond_full(start(model, request))

    @app.post("/models/{model}/generate_stream")
    async def generate_stream(model: str, request: ClientRequest = Depends(client_request)):
        return respond_stream(start(model, request), request)

    async def one_event(value: int):
        yield sse_message(value)

    @app.get("/serving/get_bs")
    async def get_bs(group: int | None = None):
        """?group=N: that replica's batch (group N is the agent of port N in agents.ports)."""
        if group is not None and not 0 <= group < len(llm_server.clients):
            raise ApiError(400, f"group {group} does not exist (groups: 0..{len(llm_server.clients) - 1})")
        return EventSourceResponse(one_event(llm_server.get_bs_current(group)))

    @app.get("/serving/get_request_numbers")
    async def get_request_numbers():
        return EventSourceResponse(one_event(llm_server.get_queue_current()))

    return app
