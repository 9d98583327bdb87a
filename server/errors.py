"""Errors the HTTP layer answers with, in the shape each API's clients expect:
native `{"error": message}`; OpenAI `{"error": {"message", "type", "param", "code"}}`; Anthropic
(/v1/messages) `{"type": "error", "error": {"type", "message"}}`."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Literal

from fastapi.responses import JSONResponse

from scheduler.batch_scheduler import Refusal

RETRY_AFTER_S = "1"
# vLLM's tokenizer endpoints answer in OpenAI's error shape, as the /v1/ paths do.
OPENAI_ROOT_PATHS = ("/tokenize", "/detokenize")
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


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


def is_openai_path(path: str) -> bool:
    return path.startswith("/v1/") or path in OPENAI_ROOT_PATHS


def error_shape(path: str) -> ErrorShape:
    """The error shape the clients of this path parse."""
    if path == ANTHROPIC_PREFIX or path.startswith(ANTHROPIC_PREFIX + "/"):
        return "anthropic"
    return "openai" if is_openai_path(path) else "native"


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


def refusal_status(reason: Refusal, openai: bool = False) -> int:
    """The HTTP status of a refused request. OpenAI's clients expect 429 for "no room now" (and
    retry it); the native API's clients know 503 for it."""
    return 429 if openai and reason is Refusal.OVERLOADED else REFUSAL_STATUS[reason]


def error_response(
    status: int,
    message: str,
    shape: ErrorShape | bool = False,
    param: str | None = None,
    code: str | None = None,
    headers: Mapping[str, str] | None = None,
) -> JSONResponse:
    """`shape`: an ErrorShape, or True for OpenAI's and False for the native one."""
    headers = dict(headers or {})
    if status in (429, 503):
        headers["Retry-After"] = RETRY_AFTER_S
    if isinstance(shape, bool):
        shape = "openai" if shape else "native"
    body = error_body(status, message, shape, param, code)
    return JSONResponse(body, status_code=status, headers=headers or None)
