"""Waiting on a condition instead of on the clock: a test that must see something happen (a line
printed, a process gone, a metric reaching a value, a stream's first token) polls for that very
thing, and fails naming it. `wait_until` for plain tests, `wait_until_async` inside an event loop
(it polls with asyncio.sleep, so the loop it waits on keeps running)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def wait_until(condition: Callable[[], T], timeout: float, what: str, poll_s: float = 0.05) -> T:
    """Poll `condition` until it returns something true -> that value; an AssertionError naming
    `what`, the seconds waited and the last value once `timeout` seconds pass. An exception
    `condition` raises ends the wait at once."""
    deadline = time.monotonic() + timeout
    while not (value := condition()):
        if time.monotonic() > deadline:
            raise AssertionError(f"waited {timeout:g}s for {what}; last seen: {value!r}")
        time.sleep(poll_s)
    return value


async def wait_until_async(condition: Callable[[], T], timeout: float, what: str, poll_s: float = 0.01) -> T:
    """`wait_until` inside an event loop."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not (value := condition()):
        if loop.time() > deadline:
            raise AssertionError(f"waited {timeout:g}s for {what}; last seen: {value!r}")
        await asyncio.sleep(poll_s)
    return value
