"""A client that stops reading must not keep its slot: plain ASGI middleware bounding each write of a
response body (`server.stream_write_timeout_s`).

uvicorn waits before each write while the socket's buffers are full (its flow control), so a client
that connects, asks for a long streamed answer and never reads would hold its sequence's slot and
KV blocks for as long as the answer takes, or forever. A write that waits longer than the bound
ends the response: the connection is closed, the answer's generator is closed with it, which aborts
its request and frees its slot.
"""

from __future__ import annotations

import asyncio
import logging

log = logging.getLogger(__name__)


class ClientStalled(Exception):
    """The client read nothing for the whole bound while the server had an answer to write."""


class StalledClientMiddleware:
    def __init__(self, app, timeout_s: float):
        self.app, self.timeout_s = app, timeout_s

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def bounded_send(message) -> None:
            if message["type"] != "http.response.body":
                return await send(message)
            try:
                async with asyncio.timeout(self.timeout_s):
                    await send(message)
            except TimeoutError:
                raise ClientStalled from None

        try:
            await self.app(scope, receive, bounded_send)
        except ClientStalled:
            # uvicorn closes a connection whose response the app left unfinished (and says so).
            client = scope.get("client")
            log.warning(
                "%s %s: the client at %s read nothing for %gs (server.stream_write_timeout_s): "
                "its answer is dropped and its slot freed",
                scope["method"],
                scope["path"],
                f"{client[0]}:{client[1]}" if client else "?",
                self.timeout_s,
            )
