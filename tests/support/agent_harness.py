"""Helpers to run `start_agent.py` as a real subprocess and talk to its agents over ZeroMQ."""

from __future__ import annotations

import contextlib
import random
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import psutil
import yaml
import zmq

from agent.contract import protocol
from config.schema import PROJECT_ROOT
from waiting import wait_until


def free_ports(n: int) -> list[int]:
    sockets = [socket.socket() for _ in range(n)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


def curve_keys(agents: int) -> dict:
    """A fresh agents.curve section: the server's keypair and one per agent."""
    server_public, server_secret = zmq.curve_keypair()
    keypairs = [zmq.curve_keypair() for _ in range(agents)]
    return {
        "server_public_key": server_public.decode(),
        "server_secret_key": server_secret.decode(),
        "agents": [{"public_key": p.decode(), "secret_key": s.decode()} for p, s in keypairs],
    }


# Tiny-model runtime with 8 slots and room for long answers (streams that outlast a poll or a signal).
LONG_ANSWERS_RUNTIME = {
    "num_slots": 8,
    "max_seq_len": 512,
    "prefill_buckets": [16, 64],
    "decode_batch_buckets": [1, 2, 4, 8],
    "attend_buckets": [64, 512],
    "compile_cache_dir": None,
}


def write_config(directory: Path, model_path: Path, ports: list[int], **sections) -> Path:
    config = {
        "model": {"name": "tiny", "path": str(model_path)},
        "runtime": {
            "num_slots": 4,
            "max_seq_len": 64,
            "prefill_buckets": [16, 64],
            "decode_batch_buckets": [1, 2, 4],
            "attend_buckets": [32, 64],
            "compile_cache_dir": None,
        },
        "agents": {"ports": ports, "startup_timeout_s": 180, "shutdown_grace_s": 5},
        "logging": {"dir": str(directory / "logs")},
    }
    for section, values in sections.items():
        config.setdefault(section, {}).update(values)
    path = directory / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


class LauncherProcess:
    """`python start_agent.py --config PATH` (or another entry script, or `python -m module`) with
    its output collected line by line. `args` follow the config; `prefix` runs it through another
    command (a network namespace: `ip netns exec NAME`)."""

    def __init__(
        self,
        config_path: Path,
        script: str = "start_agent.py",
        args: tuple = (),
        prefix: tuple = (),
        module: str | None = None,
    ):
        self.config_path = config_path
        entry = ["-m", module] if module else [str(PROJECT_ROOT / script)]
        self.process = subprocess.Popen(
            [*prefix, sys.executable, *entry, "--config", str(config_path), *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            cwd=PROJECT_ROOT,
        )
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.process.stdout:
            self.lines.append(line.rstrip("\n"))

    def output(self) -> str:
        return "\n".join(self.lines)

    def wait_for(self, text: str, timeout: float, start: int = 0) -> int:
        """Index of the first line from `start` on containing `text` (fails at once if the process
        ended without printing it)."""

        def found() -> list[int]:
            at = [i for i in range(start, len(self.lines)) if text in self.lines[i]][:1]
            if not at and self.process.poll() is not None and not self._reader.is_alive():
                raise AssertionError(f"{text!r} never printed: the process exited ({self.process.poll()})")
            return at

        try:
            return wait_until(found, timeout, f"{text!r} printed", poll_s=0.1)[0]
        except AssertionError as exc:
            raise AssertionError(f"{exc}; output:\n{self.output()}") from None

    def agent_pids(self) -> list[int]:
        return [c.pid for c in self._children() if "resource_tracker" not in " ".join(c.cmdline())]

    def descendant_pids(self) -> list[int]:
        """Every process below this one (multiprocessing's resource tracker included)."""
        return [c.pid for c in self._children()]

    def _children(self) -> list[psutil.Process]:
        try:
            return psutil.Process(self.process.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return []

    def close(self) -> None:
        pids = self.agent_pids()
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(10)
        for pid in pids:
            try:
                psutil.Process(pid).kill()
            except psutil.NoSuchProcess:
                pass


def supervised_stop(process: subprocess.Popen, grace_s: float) -> tuple[str, int | None]:
    """What a supervisor (systemd, Kubernetes, supervisord) does: SIGTERM, then SIGKILL once the
    grace period is over. ("exited", code) if the process ended by itself, else ("killed", None)."""
    process.send_signal(signal.SIGTERM)
    try:
        return "exited", process.wait(grace_s)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
        return "killed", None


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def thread_cpu_seconds(pid: int) -> dict[int, float]:
    """The CPU seconds each thread of the process has run so far, by thread id."""
    return {t.id: t.user_time + t.system_time for t in psutil.Process(pid).threads()}


def worker_thread_busy(pid: int, since: dict[int, float], seconds: float = 0.1) -> bool:
    """Whether a thread of the process other than its main one (a server's event loop) has run
    `seconds` of CPU since `since` (thread_cpu_seconds then): work off the loop under way, such as
    a long prompt tokenized or a grammar compiled in a pool."""
    return any(
        cpu - since.get(thread, 0.0) >= seconds
        for thread, cpu in thread_cpu_seconds(pid).items()
        if thread != pid
    )


def wait_gone(pids: list[int], timeout: float) -> list[int]:
    """The pids still alive once they all ended, or `timeout` seconds passed (the caller asserts)."""
    with contextlib.suppress(AssertionError):
        wait_until(lambda: not any(alive(p) for p in pids), timeout, "the processes gone", poll_s=0.1)
    return [p for p in pids if alive(p)]


def slot_blocks(slot: int, blocks_per_seq: int = 4) -> np.ndarray:
    """The blocks of `slot` when each slot owns a whole sequence's: the test runtime's 4 blocks of 16
    positions (max_seq_len 64)."""
    return np.arange(slot * blocks_per_seq, (slot + 1) * blocks_per_seq, dtype=np.int32)


class AgentSocket:
    """A plain synchronous DEALER for tests: send one request, wait for its reply. With `session`
    it opens one (`reset`: every slot released) and names it in each slot operation, as a server does."""

    def __init__(self, port: int, host: str = "127.0.0.1", session: bool = True):
        self.socket = zmq.Context.instance().socket(zmq.DEALER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.connect(f"tcp://{host}:{port}")
        self.next_id = 0
        self.session = random.getrandbits(62) if session else None
        if self.session is not None:
            assert self.call("reset", session=self.session)[0]["ok"]

    def raw(self, frames: list, timeout: float = 30.0):
        self.socket.send_multipart(frames)
        if not self.socket.poll(int(timeout * 1000)):
            raise TimeoutError(f"no reply within {timeout}s")
        return protocol.decode(self.socket.recv_multipart())

    def call(self, op: str, arrays=(), timeout: float = 30.0, **fields):
        if self.session is not None and op in protocol.SESSION_OPS:
            fields.setdefault("session", self.session)
        self.next_id += 1
        header, out = self.raw(
            protocol.encode({"op": op, "id": self.next_id, **fields}, [np.asarray(a) for a in arrays]),
            timeout,
        )
        assert header["id"] == self.next_id
        return header, out

    def prefill(self, slot: int, tokens, sampling: dict | None = None, **fields):
        """A whole prompt into the slot's own blocks (slot_blocks): a step of one chunk, whose map
        `fields` change (as a hostile peer may). Its first token: reply["chunk_tokens"][0]."""
        arrays = [
            np.zeros(0, np.int32),
            np.zeros((0, 0), np.int32),
            np.asarray(tokens, np.int32),
            slot_blocks(slot),
        ]
        chunk = {"slot": slot, "start": 0, "sample": True, "sampling": sampling or {}, **fields}
        return self.call("step", arrays, chunks=[chunk])

    def decode(self, slots: list[int], timeout: float = 30.0):
        """A step that decodes the slots (their own blocks); their tokens are the reply's array."""
        tables = np.stack([slot_blocks(s) for s in slots])
        return self.call("step", [np.asarray(slots, np.int32), tables], timeout, chunks=[])

    def close(self) -> None:
        self.socket.close(linger=0)


@contextlib.contextmanager
def serving_stack(config_path: Path, agents_timeout: float = 240):
    """`start_agent.py` then `start_server.py` on one config, as a user runs them; yields
    (agents, server) launcher processes and kills whatever is left on exit."""
    agents = LauncherProcess(config_path)
    server = None
    try:
        agents.wait_for("all agents started", agents_timeout)
        server = LauncherProcess(config_path, script="start_server.py")
        server.wait_for("Application startup complete", 120)
        yield agents, server
    finally:
        if server is not None:
            server.close()
        agents.close()
