"""`make serve`: start the agents, wait until they are ready, start the HTTP server; stop both on
Ctrl-C or SIGTERM (the server first, so it drains, then the agents).

    python -m tools.serve [--config PATH]
"""

from __future__ import annotations

import argparse
import signal
import subprocess
import sys
import threading

from config.schema import PROJECT_ROOT

READY_LINE = "all agents started"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config")
    args = parser.parse_args()
    extra = ["--config", args.config] if args.config else []
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())

    agents = subprocess.Popen(
        [sys.executable, str(PROJECT_ROOT / "start_agent.py"), *extra],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # our signal handling decides, not the tty's
    )
    ready = threading.Event()

    def relay() -> None:
        assert agents.stdout is not None  # stdout=PIPE
        for line in agents.stdout:
            sys.stdout.write(line)
            sys.stdout.flush()
            if READY_LINE in line:
                ready.set()

    threading.Thread(target=relay, daemon=True).start()
    while not ready.is_set():
        if stop.is_set() or agents.poll() is not None:
            return _shutdown(None, agents)
        ready.wait(0.2)
    server = subprocess.Popen(
        [sys.executable, str(PROJECT_ROOT / "start_server.py"), *extra], start_new_session=True
    )
    while not stop.is_set() and server.poll() is None and agents.poll() is None:
        stop.wait(0.2)
    return _shutdown(server, agents)


def _shutdown(server: subprocess.Popen | None, agents: subprocess.Popen) -> int:
    codes = []
    for process in (server, agents):
        if process is None:
            continue
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
        codes.append(process.wait())
    return max((abs(c) for c in codes), default=0)


if __name__ == "__main__":
    sys.exit(main())
