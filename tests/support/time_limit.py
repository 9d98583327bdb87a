"""A wall-clock bound on a block of test code, for tests that prove a scan stays linear."""

from __future__ import annotations

import contextlib
import signal


@contextlib.contextmanager
def deadline(seconds: float):
    """Fails the block if it runs longer (SIGALRM: `re` checks signals while it backtracks)."""

    def expire(signum, frame):
        raise TimeoutError(f"still running after {seconds} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
