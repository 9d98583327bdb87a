"""Errors the HTTP layer answers with, in the shape each API's clients expect (its ApiStyle):
native `{"error": message}`; OpenAI `{"error": {"message", "type", "param", "code"}}`; Anthropic
(/v1/messages) `{"type": "error", "error": {"type", "message"}}`; and the statuses of the engine's
refusals (REFUSAL_STATUS) and of its failed answers (FAULT_STATUS), the one place either is mapped."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from fastapi import Depends, Request, params
from fastapi.responses import JSONResponse

from scheduler.engine_io import FaultKind, Refusal

RETRY_AFTER_S = "1"
# vLLM's tokenizer endpoints answer in OpenAI's error shape, as the /v1/ paths do.
OPENAI_ROOT_PATHS = ("/tokenize", "/detokenize", "/tokenizer_info")
OPENAI_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "invalid_request_error",
    408: "invalid_request_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    503: "server_error",
}
# Anthropic's error types by status (its clients retry 429 and 5xx; 529 is its "overloaded").
ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    408: "invalid_request_error",
    413: "request_too_large",
    422: "invalid_request_error",
    429: "rate_limit_error",
    503: "overloaded_error",
}
ANTHROPIC_PREFIX = "/v1/messages"
ErrorShape = Literal["native", "openai", "anthropic"]
REFUSAL_STATUS = {
    Refusal.EMPTY_PROMPT: 400,
    Refusal.TOO_LONG: 413,
    Refusal.OVERLOADED: 503,
    Refusal.CLIENT_LIMIT: 429,
    Refusal.NO_GROUP: 503,
    Refusal.NOT_READY: 503,
    Refusal.SHUTTING_DOWN: 503,
}

# The HTTP status of a request that ended with an error, by the kind of its fault (the one place
# a fault becomes a status): its group failed or the server stops (try again), its own parameters
# left nothing to sample, a value of its own could not be computed.
FAULT_STATUS = {FaultKind.UNAVAILABLE: 503, FaultKind.REQUEST: 400, FaultKind.INTERNAL: 500}


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


@dataclass(frozen=True)
class ApiStyle:
    """What one API's clients expect of its errors, chosen once per API (its router declares it:
    `declares(STYLE)`): the JSON shape, the status of a body that fails validation, of a parameter
    refused after it (an answer length that can never fit, a grammar that does not compile: TGI
    answers 422, vLLM 400) and of "no room now" (OpenAI's clients retry 429; the native ones know 503)."""

    shape: ErrorShape
    invalid_body: int
    bad_parameter: int
    overloaded: int


NATIVE = ApiStyle("native", 422, 422, 503)
TRITON = ApiStyle("native", 400, 422, 503)
OPENAI = ApiStyle("openai", 400, 400, 429)
ANTHROPIC = ApiStyle("anthropic", 400, 400, 429)


def declares(style: ApiStyle) -> params.Depends:
    """A router dependency: its routes answer errors in `style` (style_of reads it)."""

    def declare(request: Request) -> None:
        request.state.api_style = style

    return Depends(declare)


def style_of(request: Request) -> ApiStyle:
    """The style its route declared; a request that reached no route (404, 405) by its path."""
    return getattr(request.state, "api_style", None) or path_style(request.url.path)


def path_style(path: str) -> ApiStyle:
    """The style of a path before routing (the access checks) or where no route matched."""
    if path == ANTHROPIC_PREFIX or path.startswith(ANTHROPIC_PREFIX + "/"):
        return ANTHROPIC
    if path.startswith("/v1/") or path in OPENAI_ROOT_PATHS:
        return OPENAI
    return TRITON if path.startswith("/v2/") else NATIVE


def error_body(status: int, message: str, shape: ErrorShape, param: str | None = None, code=None) -> dict:
    if shape == "anthropic":
        return {
            "type": "error",
            "error": {"type": ANTHROPIC_TYPES.get(status, "api_error"), "message": message},
        }
    if shape == "openai":
        kind = OPENAI_TYPES.get(status, "server_error")
        return {"error": {"message": message, "type": kind, "param": param, "code": code}}
    return {"error": message}


def fault_status(fault: FaultKind | None) -> int:
    """The status of an answer that failed with this fault (503 when it names none)."""
    return FAULT_STATUS[fault or FaultKind.UNAVAILABLE]


def refusal_status(reason: Refusal, style: ApiStyle = NATIVE) -> int:
    """The HTTP status of a refused request in the API's style ("no room now" differs)."""
    return style.overloaded if reason is Refusal.OVERLOADED else REFUSAL_STATUS[reason]


def error_response(
    status: int,
    message: str,
    shape: ErrorShape = "native",
    param: str | None = None,
    code: str | None = None,
    headers: Mapping[str, str] | None = None,
) -> JSONResponse:
    headers = dict(headers or {})
    if status in (429, 503):
        headers["Retry-After"] = RETRY_AFTER_S
    body = error_body(status, message, shape, param, code)
    return JSONResponse(body, status_code=status, headers=headers or None)
