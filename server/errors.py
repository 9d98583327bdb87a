"""Errors the HTTP layer answers with, in the shape each API's clients expect:
native `{"error": message}`; OpenAI `{"error": {"message", "type", "param", "code"}}`."""
from __future__ import annotations

from fastapi.responses import JSONResponse

RETRY_AFTER_S = "1"
OPENAI_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "invalid_request_error",
                413: "invalid_request_error", 422: "invalid_request_error", 429: "rate_limit_error",
                503: "server_error"}


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


def error_response(status: int, message: str, openai: bool = False, param: str | None = None,
                   code: str | None = None, headers: dict | None = None) -> JSONResponse:
    headers = dict(headers or {})
    if status in (429, 503):
        headers["Retry-After"] = RETRY_AFTER_S
    body = ({"error": {"message": message, "type": OPENAI_TYPES.get(status, "server_error"),
                       "param": param, "code": code}} if openai else {"error": message})
    return JSONResponse(body, status_code=status, headers=headers or None)
