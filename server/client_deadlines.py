"""Deadlines on a client's pace, so that a slow or stalled client holds neither a connection nor a
slot: SlowClientGuard bounds the arrival of each request head (slowloris: uvicorn's h11 protocol
with a deadline; the plain server runs it, server/http_server.py, and so does Ray Serve's HTTP proxy
under tools.ray_serve, tools/ray_serve/http_guard.py: both by server.read_timeout_s), and
StalledClientMiddleware each write of a response body (server.stream_write_timeout_s).

uvicorn waits before each write while the socket's buffers are full (its flow control), so a client
that connects, asks for a long streamed answer and never reads would hold its sequence's slot and
KV blocks for as long as the answer takes, or forever. A write that waits longer than the bound
ends the response: the connection is closed, the answer's generator is closed with it, which aborts
its request and frees its slot.
"""

from __future__ import annotations

import asyncio
import logging

from uvicorn.protocols.http.h11_impl import H11Protocol

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


class SlowClientGuard(H11Protocol):
    """h11 with a deadline for each request head (slowloris): from the connection's start, and from
    the end of its previous response, the request line and headers must arrive within
    `head_timeout_s`, else the connection is closed. uvicorn bounds only the idle wait between
    requests (timeout_keep_alive), and any byte resets that."""

    head_timeout_s = 10.0  # set from the config by serve()
    _head_deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._expect_head()

    def on_response_complete(self) -> None:
        self._expect_head()  # before uvicorn handles a pipelined request's head, which counts
        super().on_response_complete()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._head_deadline is not None:
            self._head_deadline.cancel()
        super().connection_lost(exc)

    def _expect_head(self) -> None:
        """Close the connection unless a new request (a new cycle) has begun by the deadline."""
        if self._head_deadline is not None:
            self._head_deadline.cancel()
        last_cycle = self.cycle
        self._head_deadline = self.loop.call_later(self.head_timeout_s, self._close_if_idle, last_cycle)

    def _close_if_idle(self, last_cycle) -> None:
        if self.cycle is last_cycle and not self.transport.is_closing():
            self.transport.close()
