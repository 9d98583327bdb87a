"""The wait for a whole answer that ends when its client goes: the answer's generation is
stopped and its slot freed, and the access log shows 499."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

from fastapi import Request
from fastapi.responses import Response

from server.output import AnswerStream

T = TypeVar("T")
CLIENT_GONE = 499  # nginx's "client closed request": nobody reads it; the access log shows it


async def unless_disconnected(
    request: Request, streams: list[AnswerStream], work: Awaitable[T]
) -> T | Response:
    """The result of `work` (which reads `streams` to their end), unless the client disconnects
    first: then `work` is cancelled and the streams closed, which aborts their requests and frees
    their slots. (Streaming responses watch for the disconnect themselves.)"""
    working = asyncio.ensure_future(work)
    watching = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait((working, watching), return_when=asyncio.FIRST_COMPLETED)
    finally:
        watching.cancel()
        if not working.done():
            working.cancel()
            await asyncio.gather(working, return_exceptions=True)
        for stream in streams:  # work cancelled before its first step never opened them
            await stream.aclose()
    if working.cancelled():
        return Response(status_code=CLIENT_GONE)
    return working.result()


async def _disconnected(request: Request) -> None:
    """Returns when the client disconnects (the body was read: nothing else arrives before)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
