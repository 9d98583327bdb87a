"""Ray Serve autoscaling (python -m tools.ray_serve): under sustained load the replica count goes
1 -> 2, and back to 1 once the load falls, with no request failed during either change (the one
still streaming when a replica is removed finishes there). Minutes long: `make test-long`."""

import re
import threading
import time

import httpx
import pytest
from test_ray_serve import replicas, sse_events

from agent_harness import LONG_ANSWERS_RUNTIME, LauncherProcess, free_ports, write_config
from http_client import TIMEOUT
from waiting import wait_until

pytestmark = pytest.mark.long

RAY = {
    "min_replicas": 1,
    "max_replicas": 2,
    "num_cpus": 0.5,
    "target_load_per_replica": 2,  # 6 streams want 3 replicas (2 at most); 1 stream wants 1
    "upscale_delay_s": 2,
    "downscale_delay_s": 5,
    "drain_timeout_s": 30,
}
ANSWER = {"max_new_tokens": 64, "ignore_eos": True}


class Client(threading.Thread):
    """Streams answers back to back until stopped; counts the whole ones and the failed ones."""

    def __init__(self, base: str, index: int):
        super().__init__(daemon=True)
        self.base, self.index = base, index
        self.stop = threading.Event()
        self.whole, self.failed = 0, []

    def run(self) -> None:
        while not self.stop.is_set():
            try:
                events = sse_events(self.base, f"client {self.index} says", "", ANSWER)
                text = "".join(e["data"] for e in events[:-1])
                if events[-1]["event"] != "message" or events[-1]["data"] != text:
                    self.failed.append(events[-3:])
                else:
                    self.whole += 1
            except AssertionError as exc:  # a status other than 200
                self.failed.append(str(exc))


def answered(base: str) -> dict[str, float]:
    """Per replica: the answers it finished (0 before its first)."""
    counts = {}
    for replica in replicas(base):
        text = httpx.get(f"{base}/metrics?replica={replica}", timeout=TIMEOUT).text
        found = re.search(r'^llm_serving_requests_total\{model="tiny",outcome="ok"\} (\S+)$', text, re.M)
        counts[replica] = float(found.group(1)) if found else 0.0
    return counts


def both_answered(base: str, before: dict[str, float], n: int) -> bool:
    """Two replicas, each with `n` answers finished since `before` (answered then)."""
    now = answered(base)
    return len(now) == 2 and all(count - before.get(r, 0.0) >= n for r, count in now.items())


def test_replicas_follow_the_load_up_and_down_without_a_failed_request(tmp_path, tiny_llama_dir):
    port = free_ports(1)[0]
    path = write_config(
        tmp_path, tiny_llama_dir, [port], runtime=LONG_ANSWERS_RUNTIME, server={"port": port}, ray=RAY
    )
    stack = LauncherProcess(path, module="tools.ray_serve", args=("--address", "local"))
    base = f"http://127.0.0.1:{port}"
    clients = [Client(base, i) for i in range(6)]
    try:
        stack.wait_for("serving on http://", 300)
        started = time.monotonic()
        for client in clients:
            client.start()
        up = stack.wait_for("replicas: 1 -> 2", 300)
        scaled_up = time.monotonic() - started  # measured for the report below: never asserted
        before = answered(base)
        wait_until(lambda: both_answered(base, before, 2), 120, "both replicas under load: answers from each")
        for client in clients[1:]:
            client.stop.set()
        for client in clients[1:]:
            client.join(120)
        fell = time.monotonic()
        stack.wait_for("replicas: 2 -> 1", 300, start=up + 1)
        scaled_down = time.monotonic() - fell
        # The last stream goes on through the removal, and answers whole after it.
        wait_until(lambda: len(replicas(base)) == 1, 120, "the second replica removed")
        whole = clients[0].whole
        wait_until(lambda: clients[0].whole > whole, 120, "an answer of the last stream after the removal")
        clients[0].stop.set()
        clients[0].join(120)
        print(f"1 -> 2 after {scaled_up:.1f}s of load; 2 -> 1 {scaled_down:.1f}s after it fell to one stream")
        assert [c.failed for c in clients] == [[]] * len(clients)
        assert all(c.whole > 0 for c in clients)
    finally:
        for client in clients:
            client.stop.set()
        stack.close()
