"""Load generation: one streaming request timed piece by piece, closed-loop levels and open-loop
Poisson arrivals."""

from __future__ import annotations

import asyncio
import itertools
import random
import time
from collections.abc import Callable, Iterator

import httpx

from tools.bench.stats import RequestRecord
from tools.bench.targets import Target, parse_line


async def one_request(client: httpx.AsyncClient, target: Target, body: dict) -> RequestRecord:
    record = RequestRecord(start=time.monotonic())
    pieces = 0
    server_count = None
    try:
        async with client.stream("POST", target.url, json=body) as response:
            if response.status_code != 200:
                text = (await response.aread()).decode(errors="replace")
                record.error = f"HTTP {response.status_code}: {text[:200]}"
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
                if event.text:
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


async def with_background(timed, target: Target, body: dict, interval_s: float):
    """Await the timed load `timed` while `body` (a long prompt) arrives every `interval_s`
    seconds beside it -> (the load's result, the background requests' records)."""
    stop = asyncio.Event()

    async def feed(client: httpx.AsyncClient) -> list[RequestRecord]:
        tasks = []
        while not stop.is_set():
            tasks.append(asyncio.create_task(one_request(client, target, body)))
            try:
                await asyncio.wait_for(stop.wait(), interval_s)
            except TimeoutError:
                pass
        return list(await asyncio.gather(*tasks))

    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0)) as client:
        feeder = asyncio.create_task(feed(client))
        result = await timed
        stop.set()
        return result, await feeder


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
