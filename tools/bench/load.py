"""Load generation: one streaming request timed piece by piece, closed-loop levels and open-loop
Poisson arrivals, and side loads beside a timed run (long prompts, hostile clients) kept apart."""

from __future__ import annotations

import asyncio
import itertools
import random
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import Any, NamedTuple, TypeVar

import httpx

from tools.bench.stats import RequestRecord
from tools.bench.targets import Target, parse_line


async def one_request(client: httpx.AsyncClient, target: Target, body: dict | bytes) -> RequestRecord:
    """`body`: a JSON object, or one already encoded (bytes: a large body is encoded once)."""
    record = RequestRecord(start=time.monotonic())
    pieces = 0  # events that carried a token
    server_count = None
    payload: dict[str, Any] = (
        {"content": body, "headers": {"content-type": "application/json", **target.headers}}
        if isinstance(body, bytes)
        else {"json": body, "headers": target.headers}
    )
    try:
        async with client.stream("POST", target.url, **payload) as response:
            record.status = response.status_code
            if response.status_code != 200:
                text = (await response.aread()).decode(errors="replace")
                record.error = f"HTTP {response.status_code}: {text[:200]}"
                record.end = time.monotonic()  # how soon a refusal came (hostile requests expect one)
                return record
            async for line in response.aiter_lines():
                event = parse_line(target.api, line)
                if event is None:
                    continue
                if event.error:
                    record.error = event.error
                    break
                if event.tokens is not None:
                    server_count = event.tokens
                if event.drafted is not None:
                    record.drafted, record.accepted = event.drafted, event.accepted
                record.text += event.text
                if event.token:
                    now = time.monotonic()
                    record.first_token = record.first_token or now
                    record.token_times.append(now)
                    pieces += 1
                if event.done:
                    break
    except httpx.HTTPError as exc:
        record.error = f"{type(exc).__name__}: {exc}"
    record.end = time.monotonic()
    record.tokens = server_count if server_count is not None else pieces
    return record


async def closed_loop(
    target: Target, bodies: Iterator[dict], concurrency: int, num_requests: int, on_done: Callable[[], None]
) -> tuple[list[RequestRecord], float]:
    """`concurrency` clients, each sending its next request as soon as the last one ends."""
    records: list[RequestRecord] = []
    remaining = itertools.islice(bodies, num_requests)

    async def client_loop(client: httpx.AsyncClient):
        for body in remaining:
            records.append(await one_request(client, target, body))
            on_done()

    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as client:
        start = time.monotonic()
        await asyncio.gather(*(client_loop(client) for _ in range(concurrency)))
        return records, time.monotonic() - start


async def chat_loop(
    target: Target,
    make_body: Callable[[str], dict],
    openers: Iterator[str],
    questions: Iterator[str],
    turns: int,
    concurrency: int,
    num_requests: int,
    on_done: Callable[[], None],
) -> tuple[list[RequestRecord], float]:
    """`concurrency` clients, each holding multi-turn chats of `turns` requests back to back: a
    turn's prompt is the chat so far (earlier prompts and their answers) and the next question."""
    records: list[RequestRecord] = []
    left = [num_requests]

    async def client_loop(client: httpx.AsyncClient):
        while left[0] > 0:
            prompt = next(openers)
            for turn in range(turns):
                if left[0] <= 0:
                    return
                left[0] -= 1
                record = await one_request(client, target, make_body(prompt))
                record.turn = turn
                records.append(record)
                on_done()
                prompt = f"{prompt}{record.text}\n\nUser: {next(questions)}\nAssistant:"

    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as client:
        start = time.monotonic()
        await asyncio.gather(*(client_loop(client) for _ in range(concurrency)))
        return records, time.monotonic() - start


T = TypeVar("T")
S = TypeVar("S")


async def beside(timed: Awaitable[T], side: Callable[[asyncio.Event], Awaitable[S]]) -> tuple[T, S]:
    """Await the timed load `timed` while `side(stop)` runs beside it; `stop` is set once the timed
    load is done, and the side load's own result is awaited after -> (the load's, the side's)."""
    stop = asyncio.Event()
    task = asyncio.ensure_future(side(stop))
    try:
        result = await timed
    except BaseException:
        task.cancel()
        raise
    stop.set()
    return result, await task


async def with_background(timed, target: Target, bodies: Iterator[dict], interval_s: float):
    """Await the timed load `timed` while the next of `bodies` (long prompts, one new token each)
    arrives every `interval_s` seconds beside it, the first after half an interval -> (the load's
    result, the background requests' records). Half an interval: a window of W seconds then gets
    W / interval_s prompts, rounded, as a steady stream seen through it would; starting at once
    gave every window one more on average, so the faster server, whose window is shorter, met the
    prompts at a higher rate (3 in 22.8 s against 3 in 28.6 s at an interval of 10 s)."""

    async def one_token(client: httpx.AsyncClient, body: dict) -> RequestRecord:
        record = await one_request(client, target, body)
        if record.error is None and record.first_token is None:
            record.first_token = record.end  # no event for its token: it had no text (part of a character)
        return record

    async def feed(stop: asyncio.Event) -> list[RequestRecord]:
        async with httpx.AsyncClient(timeout=httpx.Timeout(600.0)) as client:
            tasks = []
            wait_s = interval_s / 2
            while True:
                try:
                    await asyncio.wait_for(stop.wait(), wait_s)
                except TimeoutError:
                    pass
                if stop.is_set():
                    break
                tasks.append(asyncio.create_task(one_token(client, next(bodies))))
                wait_s = interval_s
            return list(await asyncio.gather(*tasks))

    return await beside(timed, feed)


class HostileRequest(NamedTuple):
    kind: str  # e.g. "stop_flood", "huge_prompt", "full_vocab"
    body: dict | bytes
    expect: int  # the HTTP status a well-defended server answers


HEALTH_POLL_S = 0.1


async def with_hostile(timed, target: Target, requests: Iterator[HostileRequest], clients: int):
    """Await the timed load `timed` while `clients` hostile clients send `requests` back to back
    (each takes the next one as soon as its last one ends) -> (the load's result, (a (kind, expected
    status, record) per hostile request, the latencies of GET /health polled every HEALTH_POLL_S
    meanwhile)). Once the timed load is done no new hostile request starts and those under way are
    awaited, so the next run starts on a quiet server. A client whose request did not get its
    expected status waits 0.1 s (no busy loop against a server that is down)."""

    async def client_loop(client: httpx.AsyncClient, stop: asyncio.Event, out: list) -> None:
        for request in requests:
            if stop.is_set():
                return
            record = await one_request(client, target, request.body)
            out.append((request.kind, request.expect, record))
            if record.status != request.expect:
                try:
                    await asyncio.wait_for(stop.wait(), 0.1)
                except TimeoutError:
                    pass

    async def health(stop: asyncio.Event) -> list[float]:
        latencies = []
        async with httpx.AsyncClient(timeout=httpx.Timeout(60.0)) as client:
            while not stop.is_set():
                started = time.monotonic()
                try:
                    await client.get(target.health_url)
                except httpx.HTTPError:
                    pass
                latencies.append(time.monotonic() - started)
                try:
                    await asyncio.wait_for(stop.wait(), HEALTH_POLL_S)
                except TimeoutError:
                    pass
        return latencies

    async def side(stop: asyncio.Event) -> tuple[list[tuple[str, int, RequestRecord]], list[float]]:
        out: list[tuple[str, int, RequestRecord]] = []
        limits = httpx.Limits(max_connections=clients + 4)
        polling = asyncio.ensure_future(health(stop))
        async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as client:
            await asyncio.gather(*(client_loop(client, stop, out) for _ in range(clients)))
        return out, await polling

    return await beside(timed, side)


async def open_loop(
    target: Target,
    bodies: Iterator[dict],
    rate: float,
    num_requests: int,
    seed: int,
    on_done: Callable[[], None],
) -> tuple[list[RequestRecord], float]:
    """Requests arrive as a Poisson process of `rate` per second, whatever the server's pace."""
    rng = random.Random(seed)
    async with httpx.AsyncClient(
        timeout=httpx.Timeout(600.0), limits=httpx.Limits(max_connections=None)
    ) as client:
        start = time.monotonic()
        tasks = []
        for body in itertools.islice(bodies, num_requests):
            task = asyncio.create_task(one_request(client, target, body))
            task.add_done_callback(lambda _t: on_done())
            tasks.append(task)
            await asyncio.sleep(rng.expovariate(rate))
        records = list(await asyncio.gather(*tasks))
        return records, time.monotonic() - start
