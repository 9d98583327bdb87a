"""Ray Serve (python -m tools.ray_serve): two LLMServer replicas of the tiny model, each with its own
agent, behind Ray Serve's HTTP proxy on a local Ray instance; answers compared with the plain
start_agent.py + start_server.py stack on the same config. The tests run in file order on one
stack: the agent kill replaces a replica, SIGTERM ends it all."""

import json
import re
import signal
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import psutil
import pytest
from httpx_sse import connect_sse
from test_replicas import TEXTS  # the 8 prompts (scripts, emoji, digits) replicas answer

from agent_harness import (
    LONG_ANSWERS_RUNTIME,
    LauncherProcess,
    free_ports,
    serving_stack,
    wait_gone,
    write_config,
)
from config.schema import PROJECT_ROOT
from http_client import TIMEOUT, one_event, post
from waiting import wait_until

RAY = {
    "min_replicas": 2,
    "max_replicas": 2,
    "num_cpus": 0.5,  # two replicas on a 2-core machine
    "prefix_block_chars": 16,
    "prefix_blocks": 4,
    "health_check_period_s": 1,
    "drain_timeout_s": 10,
}
LONG = {"max_new_tokens": 24, "ignore_eos": True}
GREEDY = {"model": "tiny", "temperature": 0, "max_tokens": 16}  # OpenAI's default samples
# Requests whose raw answers must be the same through Ray as without: (method, path, body).
SAME_BYTES = [
    ("POST", "/models/tiny/generate", {"inputs": "The quick brown fox", "parameters": LONG}),
    ("POST", "/models/tiny", {"inputs": "你好，世界！", "parameters": LONG}),
    (
        "POST",
        "/models/tiny/generate_stream",
        {"inputs": "emoji 😀 🎉", "parameters": {**LONG, "return_full_text": True}},
    ),
    (
        "POST",
        "/models/tiny",
        {
            "inputs": "café naïve résumé",
            "stream": True,
            "parameters": {**LONG, "return_protocol": "plain", "return_full_text": True},
        },
    ),
    ("POST", "/v1/completions", {**GREEDY, "prompt": "The capital of"}),
    ("POST", "/v1/completions", {**GREEDY, "prompt": "Numbers 0123456789", "stream": True}),
    ("POST", "/v1/chat/completions", {**GREEDY, "messages": [{"role": "user", "content": "北京"}]}),
    (
        "POST",
        "/v1/chat/completions",
        {**GREEDY, "messages": [{"role": "user", "content": "你好"}], "stream": True},
    ),
    ("POST", "/models/tiny/generate", {"inputs": 3}),  # a 422 names the field
    ("POST", "/models/nope/generate", {"inputs": "x"}),  # a 404 names the model
    ("POST", "/v1/completions", {**GREEDY, "prompt": "x" * (1 << 20)}),  # a 413, at the proxy
    ("GET", "/v1/models", None),
    ("GET", "/serving/get_bs", None),
    ("GET", "/serving/get_request_numbers", None),
]
# What differs between two runs of one OpenAI request anywhere: its id and its time.
VARYING = [
    (re.compile(rb'"id": ?"(?:cmpl|chatcmpl)-[0-9a-f]+"'), b'"id": "ID"'),
    (re.compile(rb'"created": ?\d+'), b'"created": 0'),
]


def raw(base: str, method: str, path: str, body) -> tuple[int, str, bytes]:
    response = httpx.request(method, base + path, json=body, timeout=TIMEOUT)
    content = response.content
    for pattern, replacement in VARYING:
        content = pattern.sub(replacement, content)
    return response.status_code, response.headers.get("content-type", ""), content


def generate(base: str, text: str, path: str = "/models/tiny/generate") -> str:
    response = post(base + path, {"inputs": text, "parameters": LONG})
    assert response.status_code == 200, response.text
    return response.json()["generated_text"]


@pytest.fixture(scope="module")
def plain_answers(tmp_path_factory, tiny_llama_dir):
    """The plain stack's raw answers (and TEXTS' answers), then it stops."""
    ports = free_ports(2)
    directory = tmp_path_factory.mktemp("plain")
    path = write_config(
        directory, tiny_llama_dir, [ports[0]], runtime=LONG_ANSWERS_RUNTIME, server={"port": ports[1]}
    )
    base = f"http://127.0.0.1:{ports[1]}"
    with serving_stack(path):
        return [raw(base, *request) for request in SAME_BYTES], [generate(base, t) for t in TEXTS]


@pytest.fixture(scope="module")
def ray_stack(tmp_path_factory, tiny_llama_dir, plain_answers):
    port = free_ports(1)[0]
    directory = tmp_path_factory.mktemp("ray")
    path = write_config(
        directory,
        tiny_llama_dir,
        [port],  # each replica takes ports of its own instead
        runtime=LONG_ANSWERS_RUNTIME,
        server={"port": port},
        ray=RAY,
    )
    # --address local: a Ray instance of its own, whatever else runs on this machine
    stack = LauncherProcess(path, module="tools.ray_serve", args=("--address", "local"))
    try:
        stack.wait_for("serving on http://", 300)
        yield f"http://127.0.0.1:{port}", stack, directory / "logs"
    finally:
        stack.close()  # kills what SIGTERM did not stop (after a failed test)


def replicas(base: str) -> list[str]:
    response = httpx.get(f"{base}/ray/replicas", timeout=TIMEOUT)
    assert response.status_code == 200, response.text
    return response.json()["replicas"]


def metric(base: str, replica: str, name: str, labels: str = 'model="tiny"') -> float:
    text = httpx.get(f"{base}/metrics?replica={replica}", timeout=TIMEOUT).text
    found = re.search(rf"^{name}\{{{labels}\}} (\S+)$", text, re.MULTILINE)
    assert found is not None, f"{name}{{{labels}}} not in the metrics of replica {replica}"
    return float(found.group(1))


def served(base: str) -> dict[str, float]:
    """Per replica: the requests it finished."""
    return {
        r: metric(base, r, "llm_serving_requests_total", 'model="tiny",outcome="ok"') for r in replicas(base)
    }


def test_native_and_openai_answers_are_byte_for_byte_those_without_ray(ray_stack, plain_answers):
    base, _, _ = ray_stack
    expected, _ = plain_answers
    through_ray = [raw(base, *request) for request in SAME_BYTES]
    for request, plain, ray in zip(SAME_BYTES, expected, through_ray):
        assert ray == plain, request


def test_two_replicas_serve_eight_concurrent_streams_with_unchanged_answers(ray_stack, plain_answers):
    base, _, _ = ray_stack
    _, expected = plain_answers
    assert len(replicas(base)) == 2
    alone = [generate(base, t) for t in TEXTS]
    before = served(base)
    with ThreadPoolExecutor(len(TEXTS)) as pool:  # SSE streams, 8 at once
        together = list(pool.map(lambda t: sse_text(base, t), TEXTS))
    assert together == alone == expected
    used = {r: n - before[r] for r, n in served(base).items()}
    assert sum(used.values()) == len(TEXTS) and min(used.values()) >= 1, used  # both replicas served


def sse_text(base: str, text: str, query: str = "") -> str:
    events = sse_events(base, text, query)
    assert all(e["event"] == "message" for e in events), events
    assert events[-1]["data"] == "".join(e["data"] for e in events[:-1])
    return events[-1]["data"]


def sse_events(base: str, text: str, query: str = "", parameters: dict = LONG, seen=None) -> list[dict]:
    """Every event of a streamed answer; `seen` (a list) gets them as they arrive."""
    events = [] if seen is None else seen
    body = {"inputs": text, "parameters": {**parameters, "return_full_text": True}}
    url = f"{base}/models/tiny/generate_stream{query}"
    with httpx.Client(timeout=TIMEOUT) as client, connect_sse(client, "POST", url, json=body) as source:
        assert source.response.status_code == 200, source.response.read()
        for event in source.iter_sse():
            events.append(json.loads(event.data))
    return events


def test_serving_figures_are_summed_over_replicas_or_one_replicas(ray_stack):
    base, _, _ = ray_stack
    ids = replicas(base)
    assert one_event(f"{base}/serving/get_bs") == one_event(f"{base}/serving/get_request_numbers") == 0
    assert all(one_event(f"{base}/serving/get_bs?replica={r}") == 0 for r in ids)
    seen: list[dict] = []
    streaming = threading.Thread(
        target=sse_events, args=(base, "The quick", f"?replica={ids[0]}", LONG_300, seen)
    )
    streaming.start()
    try:
        wait_until(lambda: len(seen) >= 2, 60, "the stream's first events")
        # while it streams: one sequence runs, on the replica named, and in the sum
        assert one_event(f"{base}/serving/get_bs?replica={ids[0]}") == 1
        assert one_event(f"{base}/serving/get_bs?replica={ids[1]}") == 0
        assert one_event(f"{base}/serving/get_bs") == 1
    finally:
        streaming.join()
    missing = httpx.get(f"{base}/serving/get_bs?replica=nope", timeout=TIMEOUT)
    assert missing.status_code == 404
    assert missing.json() == {"error": f"replica nope does not exist (replicas: {', '.join(ids)})"}
    bad = httpx.get(f"{base}/serving/get_bs?group=3", timeout=TIMEOUT)  # each replica's own check
    assert bad.status_code == 400 and bad.json() == {"error": "group 3 does not exist (groups: 0..0)"}


LONG_300 = {"max_new_tokens": 300, "ignore_eos": True}


def test_a_shared_prefix_lands_on_one_replica_with_cache_hits_and_unrelated_prompts_spread(ray_stack):
    base, _, _ = ray_stack
    ids = replicas(base)
    hits = {r: metric(base, r, "llm_serving_prefix_cache_hits_total") for r in ids}
    before = served(base)
    shared = "The capital of France is Paris. The quick brown fox jumps over the lazy dog. "
    for ending in ["Numbers", "café", "emoji", "北京", "symbols", "你好"]:
        generate(base, shared + ending)
    used = {r: n - before[r] for r, n in served(base).items()}
    holder = max(used, key=used.__getitem__)
    assert sorted(used.values()) == [0, 6], used
    assert metric(base, holder, "llm_serving_prefix_cache_hits_total") > hits[holder]
    assert httpx.get(f"{base}/ray/replicas", timeout=TIMEOUT).json()["routed_by_prefix"] >= 5

    before = served(base)
    # prefixes never seen before; where the router sees both replicas equally loaded it picks one at
    # random, so 16 of them (not 8: one replica getting at most 1 of 8 by chance was 7% of runs)
    unrelated = [f"{i} {text} {i}" for i, text in enumerate(TEXTS * 2)]
    with ThreadPoolExecutor(len(unrelated)) as pool:  # no shared prefix: by load
        list(pool.map(lambda t: generate(base, t), unrelated))
    used = {r: n - before[r] for r, n in served(base).items()}
    assert min(used.values()) >= 2, used


def agent_pid(logs, replica: str) -> int:
    """The pid of the replica's agent, from its launcher's readiness line."""
    text = (logs / "ray" / replica / "server_app.log").read_text()
    return int(re.findall(r"agent rank 0 ready on \S+ \(pid (\d+)", text)[-1])


def test_killing_a_replicas_agent_ends_its_streams_with_an_error_and_ray_replaces_it(ray_stack):
    base, _, logs = ray_stack
    victim, other = replicas(base)
    doomed: list[dict] = []
    spared: list[dict] = []
    threads = [
        threading.Thread(target=sse_events, args=(base, "The quick", f"?replica={victim}", LONG_300, doomed)),
        threading.Thread(target=sse_events, args=(base, "The quick", f"?replica={other}", LONG_300, spared)),
    ]
    for thread in threads:
        thread.start()
    wait_until(lambda: len(doomed) >= 3 and len(spared) >= 3, 60, "events from both streams")
    psutil.Process(agent_pid(logs, victim)).kill()
    threads[0].join(30)
    assert not threads[0].is_alive(), "the stream of the replica whose agent died did not end"
    assert doomed[-1]["event"] == "error", doomed[-3:]
    # new requests go to the other replica (a refusal by the dying one is tried there again)
    on_other = [generate(base, t, f"/models/tiny/generate?replica={other}") for t in TEXTS[:4]]
    assert [generate(base, t) for t in TEXTS[:4]] == on_other
    threads[1].join(120)
    # the other replica's stream went on to its end: its last event, the full text, is its pieces'
    assert spared[-1]["event"] == "message" and len(spared[-1]["data"]) > 0
    assert spared[-1]["data"] == "".join(e["data"] for e in spared[:-1])

    wait_until(lambda: victim not in replicas(base) and len(replicas(base)) == 2, 180, "replacement")
    assert other in replicas(base)
    assert [generate(base, t) for t in TEXTS[:4]]  # served again, without a restart


def test_a_config_without_ray_or_a_replica_that_cannot_start_is_a_clear_error(tmp_path, tiny_llama_dir):
    plain = LauncherProcess(PROJECT_ROOT / "config" / "default.yaml", module="tools.ray_serve")
    assert plain.process.wait(60) == 2
    plain.wait_for("error: the config has no ray: section (config/ray.yaml has one)", 5)

    port = free_ports(1)[0]
    path = write_config(tmp_path, tmp_path / "missing", [port], server={"port": port}, ray=RAY)
    broken = LauncherProcess(path, module="tools.ray_serve", args=("--address", "local"))
    try:
        broken.wait_for("Ray started", 120)
        processes = broken.descendant_pids()
        assert broken.process.wait(240) == 1
        broken.wait_for(f"a replica failed to start: {CHECKPOINT_ERROR}{tmp_path / 'missing'} (", 5)
        assert wait_gone(processes, 30) == []
    finally:
        broken.close()


CHECKPOINT_ERROR = "agent.model.checkpoint.CheckpointError: model path does not exist: "


def test_sigterm_stops_the_replicas_their_agents_and_ray(ray_stack):
    _, stack, _ = ray_stack
    processes = stack.descendant_pids()
    assert len(processes) >= 6  # Ray's own, the proxy and both replicas, their agents
    stack.process.send_signal(signal.SIGTERM)
    assert stack.process.wait(120) == 0, stack.output()
    assert wait_gone(processes, 30) == [], [
        psutil.Process(p).cmdline() for p in processes if psutil.pid_exists(p)
    ]
    stack.wait_for("stopped (and the Ray instance started here)", 5)
