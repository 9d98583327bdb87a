"""What bounds a gRPC client as server/access.py and server/client_deadlines.py bound an HTTP one
(server/grpc_server.py serves the calls):

- calls per peer (`CallGuard`): one client address has at most `server.grpc_max_calls_per_peer`
  calls open, RESOURCE_EXHAUSTED beyond, so that one peer's idle calls cannot take every one of the
  `server.max_connections` the server runs at once;
- a unary call's message must arrive within `server.read_timeout_s` of the call's start (one sent a
  few bytes at a time, or never): else DEADLINE_EXCEEDED. grpc.aio reads a unary message before it
  calls the servicer, so `CallGuard` serves each unary method as a client-streaming one (the same
  bytes on the wire) and reads the one message itself;
- a ModelStreamInfer stream (`answer_stream`): its requests answered side by side, at most
  `server.grpc_stream_max_requests` at once and as many replies held unsent; beyond, the stream's
  next message is not read (back-pressure: the client's sends wait on HTTP/2 flow control). A reply
  the client does not take within `server.stream_write_timeout_s` ends the stream: its running
  answers are aborted (their slots freed) and its unsent replies dropped. A stream with no request
  running that sends none within `server.grpc_idle_timeout_s` is ended (DEADLINE_EXCEEDED).

gRPC cannot reset one call from Python: the status of a stalled stream waits behind the replies its
client has not read, so the call itself ends when the client reads or goes, and counts against its
peer's calls until then.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import Counter
from collections.abc import Callable, Coroutine
from typing import Any, NamedTuple
from urllib.parse import unquote

import grpc

from config.schema import ServerSection

log = logging.getLogger(__name__)


def peer_address(context: grpc.aio.ServicerContext) -> str:
    """The client's address: ipv4:127.0.0.1:5000 -> 127.0.0.1, ipv6:%5B::1%5D:5000 -> ::1."""
    peer = unquote(context.peer() or "")
    return peer.split(":", 1)[1].rsplit(":", 1)[0].strip("[]") if ":" in peer else "unknown"


class CallGuard(grpc.aio.ServerInterceptor):
    """Calls per peer, and the read timeout of a unary call's message (the module docstring)."""

    def __init__(self, server: ServerSection):
        self.max_per_peer, self.read_timeout_s = server.grpc_max_calls_per_peer, server.read_timeout_s
        self.open: Counter[str] = Counter()

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        serialization = {
            "request_deserializer": handler.request_deserializer,
            "response_serializer": handler.response_serializer,
        }
        if handler.unary_unary:
            return grpc.stream_unary_rpc_method_handler(self._unary(handler.unary_unary), **serialization)
        if handler.stream_stream:
            return grpc.stream_stream_rpc_method_handler(self._stream(handler.stream_stream), **serialization)
        return handler  # the service has no other kind

    @contextlib.asynccontextmanager
    async def _held(self, context: grpc.aio.ServicerContext):
        peer = peer_address(context)
        if self.open[peer] >= self.max_per_peer:
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"{peer} has {self.open[peer]} gRPC calls open, the most one client may "
                "(server.grpc_max_calls_per_peer)",
            )
        self.open[peer] += 1
        try:
            yield
        finally:
            self.open[peer] -= 1
            if not self.open[peer]:
                del self.open[peer]

    def _unary(self, behavior: Callable):
        async def one_message(requests, context: grpc.aio.ServicerContext):
            async with self._held(context):
                try:
                    async with asyncio.timeout(self.read_timeout_s):
                        request = await anext(aiter(requests), None)
                except TimeoutError:
                    await context.abort(
                        grpc.StatusCode.DEADLINE_EXCEEDED,
                        f"the request message did not arrive within {self.read_timeout_s:g}s "
                        "(server.read_timeout_s)",
                    )
                if request is None:
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "the call sent no request message")
                return await behavior(request, context)

        return one_message

    def _stream(self, behavior: Callable):
        async def held_stream(requests, context: grpc.aio.ServicerContext) -> None:
            async with self._held(context):
                await behavior(requests, context)

        return held_stream


class StreamEnd(NamedTuple):
    """The status a stream ends with once the replies before it are written."""

    code: grpc.StatusCode
    details: str


Answer = Callable[[Any, asyncio.Queue], Coroutine[Any, Any, None]]


async def answer_stream(context: grpc.aio.ServicerContext, server: ServerSection, answer: Answer) -> None:
    """Reads the stream's requests and writes their replies: `answer(request, replies)` puts one
    request's replies on `replies`; the bounds are the module docstring's."""
    await _Stream(context, server, answer).run()


class _Stream:
    def __init__(self, context: grpc.aio.ServicerContext, server: ServerSection, answer: Answer):
        self.context, self.answer = context, answer
        self.idle_s, self.write_s = server.grpc_idle_timeout_s, server.stream_write_timeout_s
        limit = server.grpc_stream_max_requests
        self.replies: asyncio.Queue = asyncio.Queue(limit)  # replies, then None or a StreamEnd
        self.room = asyncio.Semaphore(limit)  # for one more running request
        self.answering: set[asyncio.Task] = set()
        self.idle: asyncio.Timeout | None = None  # the wait for a message, while one is waited for
        self.reader: asyncio.Task | None = None

    async def run(self) -> None:
        self.reader = asyncio.create_task(self._read())
        try:
            while (reply := await self.replies.get()) is not None:
                if isinstance(reply, StreamEnd):
                    await self.context.abort(reply.code, reply.details)
                try:
                    async with asyncio.timeout(self.write_s):
                        await self.context.write(reply)
                except TimeoutError:
                    await self._stalled()
        finally:
            await self._stop()

    async def _stop(self) -> None:
        """Stops reading and aborts the running answers (the client is gone or stalled)."""
        tasks = [self.reader, *self.answering] if self.reader else list(self.answering)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _stalled(self) -> None:
        running = len(self.answering)
        await self._stop()
        while not self.replies.empty():  # the status would wait behind them anyway
            self.replies.get_nowait()
        log.warning(
            "ModelStreamInfer: the client at %s read no reply for %gs (server.stream_write_timeout_s): "
            "its %d running answers are dropped and their slots freed",
            peer_address(self.context),
            self.write_s,
            running,
        )
        await self.context.abort(
            grpc.StatusCode.DEADLINE_EXCEEDED,
            f"no reply was read for {self.write_s:g}s (server.stream_write_timeout_s): the stream's "
            "answers are dropped",
        )

    async def _read(self) -> None:
        try:
            end = await self._read_requests()
        except Exception as exc:  # a message that does not parse (or the call ended): no going on
            end = StreamEnd(grpc.StatusCode.INVALID_ARGUMENT, f"a request message could not be read: {exc}")
        await self.replies.put(end)

    async def _read_requests(self) -> StreamEnd | None:
        """Starts an answer for each message, as room allows; at the end of the stream, once every
        answer has put its replies: None; after an idle wait: its StreamEnd."""
        loop = asyncio.get_running_loop()
        while True:
            await self.room.acquire()
            deadline = None if self.answering else loop.time() + self.idle_s
            try:
                async with asyncio.timeout_at(deadline) as self.idle:
                    request = await self.context.read()
            except TimeoutError:
                return StreamEnd(
                    grpc.StatusCode.DEADLINE_EXCEEDED,
                    f"no request for {self.idle_s:g}s (server.grpc_idle_timeout_s): the stream is closed",
                )
            finally:
                self.idle = None
            if request is grpc.aio.EOF:
                break
            task = asyncio.create_task(self.answer(request, self.replies))
            self.answering.add(task)
            task.add_done_callback(self._answered)
        while self.answering:
            await asyncio.wait(set(self.answering))
        return None

    def _answered(self, task: asyncio.Task) -> None:
        self.answering.discard(task)
        self.room.release()
        if not self.answering and self.idle is not None and not self.idle.expired():  # idle from now
            self.idle.reschedule(asyncio.get_running_loop().time() + self.idle_s)
