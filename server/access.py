"""Access control in front of every route, as plain ASGI middleware (it must not buffer streams):
API keys (`Authorization: Bearer KEY`; every path but /health; the dashboard page also takes
`?api_key=` since a browser cannot set the header for a page load) and the request body limit (413,
on the bytes read: a request body is read here, within the limit, and handed on).
"""

from __future__ import annotations

import hmac
from urllib.parse import parse_qs

from server.errors import error_response

OPEN_PATHS = {"/health"}
QUERY_KEY_PATHS = {"/dashboard"}


class AccessMiddleware:
    def __init__(self, app, api_keys: list[str], max_body_bytes: int):
        self.app = app
        self.api_keys = [k.encode() for k in api_keys]
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"]
        openai = path.startswith("/v1/")
        headers = dict(scope["headers"])
        if self.api_keys and path not in OPEN_PATHS and not self._authorized(scope, headers):
            response = error_response(
                401,
                "missing or invalid API key (send Authorization: Bearer KEY)",
                openai,
                code="invalid_api_key",
                headers={"WWW-Authenticate": "Bearer"},
            )
            return await response(scope, receive, send)
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body_bytes:
            return await self._too_large(scope, receive, send, openai)
        if scope["method"] not in ("POST", "PUT", "PATCH"):
            return await self.app(scope, receive, send)
        # Count what is actually read, whatever Content-Length says: with Transfer-Encoding:
        # chunked beside it, the server reads the chunks (h11 lets chunked win), of any size.
        body, more = b"", True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            body += message.get("body", b"")
            more = message.get("more_body", False)
            if len(body) > self.max_body_bytes:
                return await self._too_large(scope, receive, send, openai)
        replayed = False

        async def replay():
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        return await self.app(scope, replay, send)

    def _authorized(self, scope, headers: dict) -> bool:
        auth = headers.get(b"authorization", b"")
        key = auth[7:].strip() if auth[:7].lower() == b"bearer " else b""
        if not key and scope["path"] in QUERY_KEY_PATHS:
            key = (parse_qs(scope.get("query_string", b"").decode()).get("api_key") or [""])[0].encode()
        return any(hmac.compare_digest(key, k) for k in self.api_keys)

    async def _too_large(self, scope, receive, send, openai: bool):
        response = error_response(413, f"the request body is larger than {self.max_body_bytes} bytes", openai)
        return await response(scope, receive, send)
