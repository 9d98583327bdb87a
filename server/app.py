"""The HTTP front end: the FastAPI app with its routers (the upstream llm-serving API in
server/native_api.py, the OpenAI API, Triton's and its model repository, tokenizer, operations)
over the served models (server/model_repository.py), access control and the errors' JSON shapes.
Errors are JSON in the shape of the API's clients (each router declares its ApiStyle:
server/errors.py) with a status that says what happened.
"""

from __future__ import annotations

import contextlib

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from starlette.exceptions import HTTPException

from config.schema import ServingConfig
from server.access import AccessMiddleware
from server.anthropic_api import anthropic_router
from server.client_deadlines import StalledClientMiddleware
from server.errors import ApiError, error_response, style_of
from server.model_repository import ModelRepository
from server.native_api import native_router
from server.openai_api import openai_router
from server.ops_api import ops_router
from server.pooling_api import pooling_router
from server.repository_api import repository_router
from server.responses_api import responses_router
from server.responses_store import ResponseStore, StoreBounds
from server.tokenize_api import tokenize_router
from server.tracing import TracingMiddleware
from server.triton_api import triton_router


def create_app(config: ServingConfig, repository: ModelRepository) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI):
        # The engines are started by the server before this (server/http_server.py), where a
        # signal can cut the wait for the agents short.
        yield
        await repository.stop()

    app = FastAPI(title="ms-llm-serving", lifespan=lifespan)

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError):
        return error_response(exc.status, exc.message, style_of(request).shape, exc.param, exc.code)

    @app.exception_handler(HTTPException)
    async def _http_error(request: Request, exc: HTTPException):
        # Unknown paths and wrong methods answer in the same JSON shape as every other error.
        return error_response(exc.status_code, str(exc.detail), style_of(request).shape, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError):
        errors, style = exc.errors(), style_of(request)
        invalid = next((e for e in errors if e.get("type") == "json_invalid"), None)
        if invalid is not None:  # the parser's reason: where, and what (a lone surrogate's \ud800 escape ...)
            reason = str(invalid.get("ctx", {}).get("error", ""))[:200]
            return error_response(400, f"the request body is not valid JSON ({reason})", style.shape)
        fields = [".".join(str(p) for p in e["loc"] if p != "body") or "body" for e in errors]
        problems = "; ".join(f"{field}: {e['msg']}" for field, e in zip(fields, errors))
        return error_response(style.invalid_body, problems, style.shape, param=fields[0])

    app.include_router(openai_router(repository))
    store = ResponseStore(StoreBounds.of(config.server), config.server.responses_ttl_s)
    app.include_router(responses_router(repository, store))
    app.include_router(anthropic_router(repository))
    app.include_router(ops_router(config, repository))
    app.include_router(native_router(repository))
    app.include_router(tokenize_router(repository))
    app.include_router(pooling_router(repository))
    app.include_router(triton_router(repository))
    app.include_router(repository_router(repository))
    app.add_middleware(StalledClientMiddleware, timeout_s=config.server.stream_write_timeout_s)
    if repository.tracing is not None:  # inside the access check: a refused request makes no span
        app.add_middleware(TracingMiddleware, tracing=repository.tracing)
    app.add_middleware(
        AccessMiddleware, server=config.server, model_control=config.model_control_mode == "explicit"
    )
    if config.server.cors_origins:
        app.add_middleware(
            CORSMiddleware,
            allow_origins=config.server.cors_origins,
            allow_methods=["GET", "POST"],
            allow_headers=["Authorization", "Content-Type", "x-api-key", "anthropic-version", "traceparent"],
        )
    return app
