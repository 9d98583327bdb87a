"""Reading answers: the outputs of one request's answer streams merged in arrival order, and the
collectors of whole answers, where an answer that failed is the request's error (ApiError with its
fault's status). Every API reads its answers through these."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator

from server.errors import ApiError
from server.output import AnswerStream, GenerationOutput


async def merged(streams: list[AnswerStream]) -> AsyncGenerator[tuple[int, GenerationOutput]]:
    """The outputs of the streams as (choice index, output), in arrival order; closing this closes
    all. One stream is read as it is; several through a queue their pump tasks fill."""
    if len(streams) == 1:
        async with contextlib.aclosing(streams[0]) as stream:
            async for out in stream:
                yield 0, out
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, stream):
        async with contextlib.aclosing(stream):
            async for out in stream:
                await queue.put((index, out))
        await queue.put((index, None))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        open_streams = len(streams)
        while open_streams:
            index, out = await queue.get()
            if out is None:
                open_streams -= 1
            else:
                yield index, out
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for stream in streams:  # a pump cancelled before it started never closed its stream
            await stream.aclose()


async def collected(streams: list[AnswerStream]) -> AsyncGenerator[tuple[int, GenerationOutput]]:
    """merged(streams), where an answer that failed (a failed agent or a shutdown: 503, try again;
    or its own fault) raises its ApiError; closing this closes all."""
    async with contextlib.aclosing(merged(streams)) as outputs:
        async for index, out in outputs:
            if out.error:
                raise ApiError(out.error_status, out.error)
            yield index, out


async def whole_answer(stream: AnswerStream) -> tuple[str, list[GenerationOutput]]:
    """One answer read to its end: its text and its outputs."""
    text, outs = [], []
    async with contextlib.aclosing(collected([stream])) as outputs:
        async for _, out in outputs:
            text.append(out.text)
            outs.append(out)
    return "".join(text), outs
