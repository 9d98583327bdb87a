"""Long fault runs, outside `make test` (marked `long`; `make test-long` runs them): 200 streaming
clients that disconnect at random points, and a soak of mixed load (SOAK_S seconds, default 600)
watching the server's and the agent's memory, file descriptors and ZeroMQ connections."""

import json
import os
import random
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import psutil
import pytest
from prometheus_client.parser import text_string_to_metric_families

from agent_harness import LONG_ANSWERS_RUNTIME, free_ports, serving_stack, write_config

pytestmark = pytest.mark.long
RSS_MARGIN_MB = 30


@pytest.fixture(scope="module")
def stack(tmp_path_factory, tiny_llama_dir):
    agent_port, http_port = free_ports(2)
    path = write_config(
        tmp_path_factory.mktemp("long"),
        tiny_llama_dir,
        [agent_port],
        runtime=LONG_ANSWERS_RUNTIME,
        server={"port": http_port, "max_waiting_requests": 64},
    )
    with serving_stack(path) as (agents, server):
        yield {
            "base": f"http://127.0.0.1:{http_port}",
            "port": http_port,
            "agent_port": agent_port,
            "server": psutil.Process(server.process.pid),
            "agent": psutil.Process(agents.agent_pids()[0]),
        }


def gauges(base: str) -> dict[str, float]:
    text = httpx.get(f"{base}/metrics", timeout=10).text
    return {
        f.name: f.samples[0].value
        for f in text_string_to_metric_families(text)
        if f.type == "gauge" and f.samples and not f.samples[0].labels
    }


def wait_idle(base: str, timeout: float = 60) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while True:
        g = gauges(base)
        busy = {
            k: g[k]
            for k in (
                "llm_serving_running_sequences",
                "llm_serving_waiting_requests",
                "llm_serving_open_streams",
                "llm_serving_tokens_in_flight",
            )
            if g[k]
        }
        if not busy:
            return g
        if time.monotonic() > deadline:
            raise AssertionError(f"still busy {timeout}s after the last client left: {busy}")
        time.sleep(0.2)


def usage(stack) -> dict:
    zmq_connections = [
        c for c in stack["server"].net_connections("tcp") if c.raddr and c.raddr.port == stack["agent_port"]
    ]
    return {
        "server_rss_mb": stack["server"].memory_info().rss / 2**20,
        "agent_rss_mb": stack["agent"].memory_info().rss / 2**20,
        "server_fds": stack["server"].num_fds(),
        "zmq_connections": len(zmq_connections),
    }


def request_shape(kind: str, i: int) -> tuple[str, dict]:
    prompt = f"client {i} says"
    if kind == "openai":
        return "/v1/chat/completions", {
            "model": "tiny",
            "stream": True,
            "max_tokens": 200,
            "ignore_eos": True,
            "messages": [{"role": "user", "content": prompt}],
        }
    return "/models/tiny/generate_stream", {
        "inputs": prompt,
        "stream": True,
        "parameters": {
            "max_new_tokens": 200,
            "ignore_eos": True,
            "return_protocol": "sse" if kind == "sse" else "plain",
        },
    }


def disconnecting_client(base: str, port: int, i: int, rng: random.Random, cut: int | None = None) -> str:
    """One streaming request, dropped after `cut` lines (random if None; 0: before any byte)."""
    kind = rng.choice(["sse", "plain", "openai"])
    path, body = request_shape(kind, i)
    cut = rng.choice([0, 1, 3, 10, 50, 150, 10_000]) if cut is None else cut
    if cut == 0:  # gone before the response starts: send the request, close the socket
        payload = json.dumps(body).encode()
        with socket.create_connection(("127.0.0.1", port)) as s:
            s.sendall(
                f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(payload)}\r\n\r\n".encode()
                + payload
            )
        return "before the first byte"
    with httpx.stream("POST", base + path, json=body, timeout=120) as response:
        assert response.status_code == 200, response.read()
        lines = 0
        for line in response.iter_lines():
            lines += bool(line)
            if lines >= cut:
                return "mid-stream"
    return "read to the end"


def run_clients(stack, n: int, seed: int) -> dict[str, int]:
    rng = random.Random(seed)
    seeds = [rng.random() for _ in range(n)]
    with ThreadPoolExecutor(16) as pool:
        outcomes = list(
            pool.map(
                lambda i: disconnecting_client(stack["base"], stack["port"], i, random.Random(seeds[i])),
                range(n),
            )
        )
    return {o: outcomes.count(o) for o in set(outcomes)}


def test_200_clients_disconnecting_at_random_points_leave_nothing_behind(stack):
    base = stack["base"]
    run_clients(stack, 30, seed=1)  # warm-up: allocator arenas, connection pools
    wait_idle(base)
    before = usage(stack)
    outcomes = run_clients(stack, 200, seed=2)
    idle = wait_idle(base)
    after = usage(stack)
    print(f"\n200 clients: {outcomes}; before {before}; after {after}")
    assert sum(outcomes.values()) == 200 and outcomes.get("mid-stream")
    assert idle["llm_serving_slots_used"] == 0
    assert after["server_rss_mb"] - before["server_rss_mb"] < RSS_MARGIN_MB
    assert after["server_fds"] <= before["server_fds"] + 2
    ok = httpx.post(
        f"{base}/models/tiny/generate",
        json={"inputs": "still there?", "parameters": {"max_new_tokens": 4}},
        timeout=30,
    )
    assert ok.status_code == 200


def soak_worker(base: str, port: int, deadline: float, seed: int, counts: dict, lock: threading.Lock):
    rng = random.Random(seed)
    i = 0
    while time.monotonic() < deadline:
        i += 1
        kind = rng.choice(["native", "openai", "disconnect", "stream"])
        if kind == "disconnect":
            outcome = disconnecting_client(base, port, i, rng)
        elif kind == "stream":
            outcome = disconnecting_client(base, port, i, rng, cut=10**6).replace(
                "read to the end", "stream ok"
            )
        elif kind == "native":
            r = httpx.post(
                f"{base}/models/tiny/generate",
                timeout=120,
                json={"inputs": f"soak {i}", "parameters": {"max_new_tokens": rng.randint(1, 300)}},
            )
            outcome = (
                "native ok"
                if r.status_code == 200 and "generated_text" in r.json()
                else f"native {r.status_code}"
            )
        else:
            r = httpx.post(
                f"{base}/v1/completions",
                timeout=120,
                json={"model": "tiny", "prompt": f"soak {i}", "max_tokens": rng.randint(1, 300)},
            )
            outcome = (
                "openai ok"
                if r.status_code == 200 and r.json()["choices"][0]["finish_reason"]
                else f"openai {r.status_code}"
            )
        with lock:
            counts[outcome] = counts.get(outcome, 0) + 1


def test_soak_mixed_load_keeps_memory_descriptors_and_sockets_flat(stack):
    base, duration = stack["base"], float(os.environ.get("SOAK_S", 600))
    counts: dict[str, int] = {}
    lock = threading.Lock()
    deadline = time.monotonic() + duration
    workers = [
        threading.Thread(target=soak_worker, args=(base, stack["port"], deadline, s, counts, lock))
        for s in range(8)
    ]
    for w in workers:
        w.start()
    samples = []
    while any(w.is_alive() for w in workers):
        samples.append(usage(stack))
        time.sleep(min(30, duration / 10))
    for w in workers:
        w.join()
    wait_idle(base)
    samples.append(usage(stack))
    print(f"\nsoak {duration:.0f}s: {counts}")
    for s in samples:
        print("  " + ", ".join(f"{k} {v:.1f}" for k, v in s.items()))
    bad = {
        k: v
        for k, v in counts.items()
        if not k.endswith("ok") and k not in ("mid-stream", "before the first byte", "read to the end")
    }
    assert not bad, bad
    settled = samples[len(samples) // 3 :]  # after warm-up
    for key in ("server_rss_mb", "agent_rss_mb"):
        assert max(s[key] for s in settled) - settled[0][key] < RSS_MARGIN_MB, (key, samples)
    assert max(s["server_fds"] for s in settled) - min(s["server_fds"] for s in settled) <= 20
    assert samples[-1]["server_fds"] <= settled[0]["server_fds"] + 2
    assert {s["zmq_connections"] for s in samples} == {1}
