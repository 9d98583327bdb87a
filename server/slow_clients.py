"""SlowClientGuard: uvicorn's h11 protocol with a deadline for each request head (slowloris). The
plain server runs it (server/http_server.py), and so does Ray Serve's HTTP proxy under
tools.ray_serve (tools/ray_serve/http_guard.py): both bound a head by server.read_timeout_s."""

from __future__ import annotations

import asyncio

from uvicorn.protocols.http.h11_impl import H11Protocol


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
