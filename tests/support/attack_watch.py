"""What every hostile-request test checks beside its attack: the server stays live (`GET /health`
answers within a bound all along) and a victim's request, running during the attack, ends with its
exact answer (computed alone first).

    expected = victim()
    with under_attack(base, victim, expected):
        ... the attack ...

The slowest /health answer each watch saw is kept in WORST_HEALTH_S; tests/conftest.py prints the
largest at the end of the run.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import httpx

T = TypeVar("T")
HEALTH_BOUND_S = 1.0
WORST_HEALTH_S: list[tuple[str, float]] = []  # (what was watched, its slowest /health answer)


class HealthWatch:
    """Polls `GET /health` from a thread; a failure, or an answer slower than the bound, is kept."""

    def __init__(self, base: str, name: str = "", interval_s: float = 0.05):
        self.base, self.name, self.interval_s = base, name, interval_s
        self.worst_s = 0.0
        self.polls = 0
        self.failures: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def _poll(self) -> None:
        with httpx.Client(timeout=10) as client:
            while not self._stop.is_set():
                start = time.perf_counter()
                try:
                    status = client.get(f"{self.base}/health").status_code
                    if status != 200:
                        self.failures.append(f"/health answered {status}")
                except httpx.HTTPError as exc:
                    self.failures.append(f"/health failed: {exc!r}")
                self.worst_s = max(self.worst_s, time.perf_counter() - start)
                self.polls += 1
                self._stop.wait(self.interval_s)

    def __enter__(self) -> HealthWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        WORST_HEALTH_S.append((self.name, self.worst_s))

    def check(self, bound_s: float = HEALTH_BOUND_S) -> None:
        assert self.polls > 0, "/health was never polled"
        assert not self.failures, self.failures[:3]
        assert self.worst_s < bound_s, f"/health took {self.worst_s:.2f} s (bound {bound_s} s)"


@contextlib.contextmanager
def under_attack(
    base: str, victim: Callable[[], T], expected: T, name: str = "", bound_s: float = HEALTH_BOUND_S
) -> Iterator[HealthWatch]:
    """Runs `victim` in a thread and watches /health while the block attacks; on leaving, the
    victim's answer must equal `expected` and /health must have answered within `bound_s`."""
    with HealthWatch(base, name) as health, ThreadPoolExecutor(1) as pool:
        answer = pool.submit(victim)
        yield health
        assert answer.result(timeout=300) == expected, "the victim's answer changed under attack"
    health.check(bound_s)
