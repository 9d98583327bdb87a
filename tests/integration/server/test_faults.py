"""Fault suite on the tiny model, real processes and sockets throughout: an agent killed or hung
while streams decode, the launcher restarting it, overload, SIGTERM to the server and to the
launcher under a supervisor that escalates to SIGKILL. Tests run in file order on one stack."""

import json
import os
import signal
import threading
import time

import httpx
import pytest

from agent_harness import (
    LONG_ANSWERS_RUNTIME,
    LauncherProcess,
    alive,
    free_ports,
    serving_stack,
    supervised_stop,
    wait_gone,
    write_config,
)
from http_client import one_event, post
from waiting import wait_until

# Room for answers long enough to still be running when the fault hits.
FAULT_RUNTIME = {**LONG_ANSWERS_RUNTIME, "max_seq_len": 2048, "attend_buckets": [64, 2048]}
MAX_WAITING = 4
DETECTION_BOUND_S = 5.0  # the promise: every affected request ends within this of the fault
LONG = 1900  # new tokens: an answer that outlasts the fault


@pytest.fixture(scope="module")
def stack(tmp_path_factory, tiny_llama_dir):
    agent_port, http_port = free_ports(2)
    path = write_config(
        tmp_path_factory.mktemp("faults"),
        tiny_llama_dir,
        [agent_port],
        runtime=FAULT_RUNTIME,
        agents={"restart_policy": "restart", "max_restarts": 3},
        server={"port": http_port, "drain_timeout_s": 30},
        scheduler={"max_waiting_requests": MAX_WAITING},
    )
    with serving_stack(path) as (agents, server):
        yield {
            "base": f"http://127.0.0.1:{http_port}",
            "agents": agents,
            "server": server,
            "config": path,
            "agent_address": f"tcp://127.0.0.1:{agent_port}",
        }


def body(inputs: str, max_new_tokens: int = LONG, **parameters) -> dict:
    return {
        "inputs": inputs,
        "parameters": {"max_new_tokens": max_new_tokens, "ignore_eos": True, **parameters},
    }


class Request(threading.Thread):
    """One client request in its own thread: a stream (SSE events) or a plain JSON answer.
    Records what came back and when it ended."""

    def __init__(
        self,
        base: str,
        inputs: str,
        stream: bool,
        max_new_tokens: int = LONG,
        path: str = "/models/tiny",
        **parameters,
    ):
        super().__init__(daemon=True)
        self.url, self.stream = base + path, stream
        self.body = body(inputs, max_new_tokens, **parameters)
        self.body["stream"] = stream
        self.events: list[dict] = []
        self.status = self.json = self.ended = None
        self.first = threading.Event()

    def run(self):
        with httpx.stream("POST", self.url, json=self.body, timeout=120) as response:
            self.status = response.status_code
            if self.stream and response.status_code == 200:
                for line in response.iter_lines():
                    if line.startswith("data:"):
                        self.events.append(json.loads(line[len("data:") :].strip()))
                        self.first.set()
            else:
                self.json = json.loads(response.read())
        self.ended = time.monotonic()
        self.first.set()

    @property
    def text(self) -> str:
        if not self.stream:
            return self.json["generated_text"]
        return "".join(e["data"] for e in self.events if e["event"] == "message")


def get_bs(base: str) -> int:
    return one_event(f"{base}/serving/get_bs")


def queue_depth(base: str) -> int:
    return one_event(f"{base}/serving/get_request_numbers")


def ready(base: str) -> httpx.Response:
    return httpx.get(f"{base}/ready", timeout=30)


def start_mixed_load(base: str, n_streams: int, n_plain: int) -> list[Request]:
    # Half the streams end with the whole text (return_full_text): after a failure, the error
    # must still be their last event, or the partial text would read as a finished answer.
    requests = [
        Request(base, f"fault {i}", stream=i < n_streams, return_full_text=i % 2 == 1)
        for i in range(n_streams + n_plain)
    ]
    for r in requests:
        r.start()
    for r in requests[:n_streams]:
        assert r.first.wait(60), "a stream produced nothing"
    wait_until(lambda: get_bs(base) == len(requests), 30, "all requests running")
    return requests


def assert_all_failed_fast(requests: list[Request], fault_at: float) -> list[float]:
    """Every request ended with an error saying the agent failed, within the bound."""
    delays = []
    for r in requests:
        r.join(30)
        assert not r.is_alive(), "a request hung"
        delays.append(r.ended - fault_at)
        if r.stream:
            assert r.status == 200 and r.events[-1]["event"] == "error", r.events[-3:]
            assert "failed" in r.events[-1]["data"]
        else:
            assert r.status == 503 and "failed" in r.json["error"], (r.status, r.json)
    # A clock is the subject here: the promise is a bound on how long detection takes.
    assert max(delays) < DETECTION_BOUND_S, delays
    return delays


def assert_refused_while_down(stack) -> None:
    base = stack["base"]
    response = ready(base)
    assert response.status_code == 503 and stack["agent_address"] in response.json()["error"]
    refused = post(f"{base}/models/tiny/generate", body("while down", 4))
    # Refused at admission (not queued until the agent came back, or failed from the queue later).
    assert (
        refused.status_code == 503 and "no agent is available (every agent failed" in refused.json()["error"]
    )
    assert refused.headers["retry-after"]
    assert httpx.get(f"{base}/health").status_code == 200  # the server itself stays up


def test_agent_killed_mid_stream_fails_its_requests_fast_then_comes_back(stack):
    base, agents = stack["base"], stack["agents"]
    want = post(f"{base}/models/tiny/generate", body("after the crash", 24)).json()["generated_text"]
    requests = start_mixed_load(base, n_streams=6, n_plain=2)
    (victim,) = agents.agent_pids()
    # The launcher is held while the test looks at the server with its agent down: a restart can
    # otherwise be complete (the tiny model starts in ~3 s) before the test sends its request.
    os.kill(agents.process.pid, signal.SIGSTOP)
    try:
        os.kill(victim, signal.SIGKILL)
        delays = assert_all_failed_fast(requests, time.monotonic())
        print(f"kill -9: requests ended {min(delays):.2f}-{max(delays):.2f}s after the kill")
        assert_refused_while_down(stack)
    finally:
        os.kill(agents.process.pid, signal.SIGCONT)
    # The launcher restarts the agent; the server finds it by itself.
    agents.wait_for("restarting (restart 1 of 3 within 600s)", 30)
    down_at = time.monotonic()
    wait_until(lambda: ready(base).status_code == 200, 240, "ready again")
    print(f"kill -9: serving again {time.monotonic() - down_at:.1f}s after the restart began")
    assert agents.agent_pids() != [victim]
    after = post(f"{base}/models/tiny/generate", body("after the crash", 24))
    assert after.status_code == 200 and after.json()["generated_text"] == want


def test_hung_agent_fails_its_requests_fast_and_recovers_when_resumed(stack):
    base, agents = stack["base"], stack["agents"]
    want = post(f"{base}/models/tiny/generate", body("after the hang", 24)).json()["generated_text"]
    requests = start_mixed_load(base, n_streams=3, n_plain=1)
    (victim,) = agents.agent_pids()
    os.kill(victim, signal.SIGSTOP)
    try:
        delays = assert_all_failed_fast(requests, time.monotonic())
        print(f"SIGSTOP: requests ended {min(delays):.2f}-{max(delays):.2f}s after the stop")
        assert_refused_while_down(stack)
    finally:
        os.kill(victim, signal.SIGCONT)
    wait_until(lambda: ready(base).status_code == 200, 60, "ready again")
    after = post(f"{base}/models/tiny/generate", body("after the hang", 24))
    assert after.status_code == 200 and after.json()["generated_text"] == want
    assert get_bs(base) == 0  # the requests from before the hang hold no slot


def test_overload_refuses_the_excess_at_once_and_finishes_everything_admitted(stack):
    base = stack["base"]
    slots = FAULT_RUNTIME["num_slots"]
    prompts = [f"load {i % 3}" for i in range(2 * (slots + MAX_WAITING))]
    want = {
        p: post(f"{base}/models/tiny/generate", body(p, 600)).json()["generated_text"] for p in set(prompts)
    }
    native = [Request(base, p, stream=False, max_new_tokens=600) for p in prompts]
    for r in native:
        r.start()
    wait_until(lambda: get_bs(base) == slots and queue_depth(base) == MAX_WAITING, 30, "the server full")
    # While it is full, the OpenAI API says 429 (its clients retry on it), also with Retry-After.
    started = time.monotonic()
    openai = httpx.post(
        f"{base}/v1/completions", timeout=30, json={"model": "tiny", "prompt": "one more", "max_tokens": 4}
    )
    openai_s = time.monotonic() - started
    for r in native:
        r.join(120)
    ok = [r for r in native if r.status == 200]
    refused = [r for r in native if r.status == 503]
    assert len(ok) + len(refused) == len(native)  # nothing lost, nothing else
    assert len(refused) >= len(native) - slots - MAX_WAITING and len(ok) >= slots + MAX_WAITING
    assert all("queue is full" in r.json["error"] for r in refused)
    assert all(r.text == want[r.body["inputs"]] for r in ok)
    assert openai.status_code == 429, openai.text
    assert openai.json()["error"]["type"] == "rate_limit_error" and openai.headers["retry-after"]
    print(
        f"overload: {len(ok)} admitted and finished, {len(refused)} refused with 503, "
        f"OpenAI 429 in {openai_s * 1000:.0f} ms"
    )


def test_sigterm_to_the_server_leaves_the_agents_and_a_new_server_serves(stack):
    base, agents, server = stack["base"], stack["agents"], stack["server"]
    agent_pids = agents.agent_pids()
    assert httpx.get(f"{base}/ready").status_code == 200  # a supervisor's probe (it once broke the shutdown)
    requests = start_mixed_load(base, n_streams=2, n_plain=0)
    how = supervised_stop(server.process, grace_s=60)
    assert how == ("exited", 0), how
    assert "Traceback" not in server.output() and "shutdown failed" not in server.output()
    for r in requests:
        r.join(10)
        assert r.events[-1]["event"] == "message"  # finished within the drain
        assert len(r.text) > 0
    assert [p for p in agent_pids if alive(p)] == agent_pids  # agents untouched
    stack["server"] = LauncherProcess(stack["config"], script="start_server.py")
    stack["server"].wait_for("Application startup complete", 120)
    again = post(f"{base}/models/tiny/generate", body("a new server", 8))
    assert again.status_code == 200 and again.json()["generated_text"]
    stack["server"].close()


def test_sigterm_to_the_launcher_stops_every_agent_and_exits_0(stack):
    agents = stack["agents"]
    pids = agents.descendant_pids()
    assert len(pids) >= 2  # the agent and multiprocessing's resource tracker
    how = supervised_stop(agents.process, grace_s=30)
    assert how == ("exited", 0), how
    assert not wait_gone(pids, 10), "orphaned agent processes"
    assert "all agents stopped" in agents.output()
