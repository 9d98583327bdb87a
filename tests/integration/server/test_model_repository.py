"""Several models in one server (a model repository, model_control_mode explicit): a real launcher
with its control channel, real agent processes, ZeroMQ and uvicorn, native HTTP, SSE and Triton's
own client (`tritonclient[http]`). Two tiny models of two families (Llama, and Gemma 3 with its
SentencePiece vocabulary and sliding-window layers, as config/model_repository.yaml pairs them) answer
side by side; a third needs more memory than agents.memory_limit_mb leaves, a fourth's file is corrupt.
Tests run in file order on one stack (the last stops it with SIGTERM)."""

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import psutil
import pytest
import tritonclient.http as triton
import yaml
import zmq
from httpx_sse import connect_sse
from tritonclient.utils import InferenceServerException

from agent.contract import launcher_control as control
from agent_harness import LONG_ANSWERS_RUNTIME, LauncherProcess, alive, free_ports, supervised_stop, wait_gone
from waiting import wait_until

USER, ADMIN = "user-key", "admin-key"
AUTH, ADMIN_AUTH = {"Authorization": f"Bearer {USER}"}, {"Authorization": f"Bearer {ADMIN}"}
PROMPTS = ["Once upon a time", "The capital of", "1, 2, 3,", "Hello there, my"]
TIMEOUT = 120
BUDGET_MB, LIMIT_MB = 48, 120  # two tiny models fit the limit, a third of 100 MB does not


@pytest.fixture(scope="module")
def stack(tmp_path_factory, tiny_llama_dir, tiny_qwen2_dir, tiny_gemma_path):
    directory = tmp_path_factory.mktemp("repository")
    corrupt = directory / "corrupt.gguf"
    corrupt.write_bytes(b"GGUF" + bytes(range(256)) * 8)  # the magic, then no valid header
    http, control_port, a, b, big, broken = free_ports(6)
    runtime = {**LONG_ANSWERS_RUNTIME, "memory_budget_mb": BUDGET_MB}
    config = {
        "model_control_mode": "explicit",
        "startup_models": ["a"],
        "agents": {
            "control_port": control_port,
            "memory_limit_mb": LIMIT_MB,
            "startup_timeout_s": 180,
            "shutdown_grace_s": 5,
        },
        "logging": {"dir": str(directory / "logs")},
        "server": {"port": http, "drain_timeout_s": 2, "api_keys": [USER], "admin_api_keys": [ADMIN]},
        "models": [
            {
                "name": "a",
                "aliases": ["alpha"],
                "path": str(tiny_llama_dir),
                "runtime": runtime,
                "agents": {"ports": [a]},
            },
            {"name": "b", "path": str(tiny_gemma_path), "runtime": runtime, "agents": {"ports": [b]}},
            {
                "name": "big",
                "path": str(tiny_qwen2_dir),
                "runtime": {**runtime, "memory_budget_mb": 100},
                "agents": {"ports": [big]},
            },
            {
                "name": "broken",
                "path": str(corrupt),
                "runtime": {**runtime, "memory_budget_mb": 16},
                "agents": {"ports": [broken]},
            },
        ],
    }
    path = directory / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    launcher = LauncherProcess(path)
    server = None
    try:
        launcher.wait_for("all agents started", 240)
        server = LauncherProcess(path, script="start_server.py")
        server.wait_for("Application startup complete", 120)
        yield {
            "base": f"http://127.0.0.1:{http}",
            "launcher": launcher,
            "server": server,
            "control": control_port,
        }
    finally:
        if server is not None:
            server.close()
        launcher.close()


def launcher_status(port: int) -> dict:
    """The launcher's own view, asked over its control channel as the server asks it."""
    socket = zmq.Context.instance().socket(zmq.DEALER)
    socket.setsockopt(zmq.LINGER, 0)
    socket.connect(f"tcp://127.0.0.1:{port}")
    try:
        socket.send(control.encode({"op": "status"}))
        assert socket.poll(30_000), "the launcher did not answer"
        return control.decode(socket.recv())["models"]
    finally:
        socket.close()


def tree_rss_mb(process: LauncherProcess) -> float:
    """The launcher's memory with its agents'."""
    total = 0
    for p in [
        psutil.Process(process.process.pid),
        *psutil.Process(process.process.pid).children(recursive=True),
    ]:
        try:
            total += p.memory_info().rss
        except psutil.NoSuchProcess:
            pass
    return total / (1 << 20)


def body(prompt: str, tokens: int = 24, **parameters) -> dict:
    return {"inputs": prompt, "parameters": {"max_new_tokens": tokens, **parameters}}


def generate(base: str, model: str, prompt: str, tokens: int = 24) -> str:
    reply = httpx.post(
        f"{base}/models/{model}/generate", json=body(prompt, tokens), headers=AUTH, timeout=TIMEOUT
    )
    assert reply.status_code == 200, reply.text
    return reply.json()["generated_text"]


def stream(base: str, model: str, prompt: str, tokens: int, **parameters) -> list[dict]:
    """Every SSE event of a streamed answer."""
    with (
        httpx.Client(timeout=TIMEOUT, headers=AUTH) as client,
        connect_sse(
            client, "POST", f"{base}/models/{model}/generate_stream", json=body(prompt, tokens, **parameters)
        ) as events,
    ):
        assert events.response.status_code == 200, events.response.read()
        return [json.loads(e.data) for e in events.iter_sse()]


def index(base: str) -> dict:
    reply = httpx.post(f"{base}/v2/repository/index", headers=AUTH, timeout=TIMEOUT)
    assert reply.status_code == 200, reply.text
    return {m["name"]: m for m in reply.json()}


def load(base: str, model: str, headers=ADMIN_AUTH) -> httpx.Response:
    return httpx.post(f"{base}/v2/repository/models/{model}/load", headers=headers, timeout=TIMEOUT)


def unload(base: str, model: str) -> httpx.Response:
    return httpx.post(f"{base}/v2/repository/models/{model}/unload", headers=ADMIN_AUTH, timeout=TIMEOUT)


def test_a_model_loads_on_request_with_an_admin_key(stack):
    base = stack["base"]
    states = index(base)
    assert {n: m["state"] for n, m in states.items()} == {
        "a": "READY",
        "b": "UNAVAILABLE",
        "big": "UNAVAILABLE",
        "broken": "UNAVAILABLE",
    }
    assert states["b"]["reason"] == "unloaded"
    refused = httpx.post(f"{base}/models/b/generate", json=body("x"), headers=AUTH, timeout=TIMEOUT)
    assert refused.status_code == 503 and "model 'b' is UNAVAILABLE (unloaded)" in refused.json()["error"]
    assert load(base, "b", headers={}).status_code == 401
    assert load(base, "b", headers=AUTH).status_code == 403
    assert launcher_status(stack["control"])["b"]["state"] == "UNAVAILABLE"  # nothing started
    assert load(base, "b").status_code == 200
    assert load(base, "b").status_code == 200  # idempotent
    assert index(base)["b"]["state"] == "READY" and launcher_status(stack["control"])["b"]["state"] == "READY"
    models = httpx.get(f"{base}/v1/models", headers=AUTH).json()["data"]
    assert {(m["id"], m["root"], m["state"]) for m in models} >= {
        ("a", "a", "READY"),
        ("alpha", "a", "READY"),
        ("b", "b", "READY"),
        ("big", "big", "UNAVAILABLE"),
    }
    info = httpx.get(f"{base}/info", headers=ADMIN_AUTH).json()
    assert info["model_id"] == "a" and info["model_control_mode"] == "explicit"
    assert [(m["model_id"], m["state"], m["slots"]) for m in info["models"]][:2] == [
        ("a", "READY", 8),
        ("b", "READY", 8),
    ]


def test_two_models_answer_as_alone_under_concurrent_load(stack):
    base = stack["base"]
    alone = {(m, p): generate(base, m, p) for m in ("a", "b") for p in PROMPTS}
    assert all(alone[("a", p)] != alone[("b", p)] for p in PROMPTS)  # two models, not one twice
    jobs = [(m, p, s) for m in ("a", "b") for p in PROMPTS for s in (False, True)]

    def ask(job):
        model, prompt, streamed = job
        if not streamed:
            return generate(base, model, prompt)
        events = stream(base, model, prompt, 24)
        assert all(e["event"] == "message" for e in events), events
        return "".join(e["data"] for e in events)

    with ThreadPoolExecutor(len(jobs)) as pool:
        together = list(pool.map(ask, jobs))
    assert together == [alone[(m, p)] for m, p, _ in jobs]
    assert generate(base, "alpha", PROMPTS[0]) == alone[("a", PROMPTS[0])]

    unknown = httpx.post(f"{base}/models/gpt-5/generate", json=body("x"), headers=AUTH)
    assert unknown.status_code == 404 and "served: a, alpha, b, big, broken" in unknown.json()["error"]
    openai = httpx.post(f"{base}/v1/completions", json={"model": "gpt-5", "prompt": "x"}, headers=AUTH)
    assert openai.status_code == 404 and "a, alpha, b" in openai.json()["error"]["message"]
    # The operator's counters (prefix-cache hits among them: whether another client's prompt was
    # cached) are the admin keys' where any are set.
    for path in ("/metrics", "/info", "/dashboard"):
        refused = httpx.get(f"{base}{path}", headers=AUTH)
        assert refused.status_code == 403 and "server.admin_api_keys" in refused.text, (path, refused.text)
    # and so is dropping the prefix cache (the answers above cached theirs)
    refused = httpx.post(f"{base}/reset_prefix_cache?model=a", headers=AUTH)
    assert refused.status_code == 403 and "server.admin_api_keys" in refused.text, refused.text
    dropped = httpx.post(f"{base}/reset_prefix_cache?model=alpha", headers=ADMIN_AUTH)
    assert dropped.status_code == 200, dropped.text
    assert dropped.json()["model"] == "a" and dropped.json()["pool_blocks"] > 0, dropped.text
    assert dropped.json()["tier_blocks"] == 0
    again = httpx.post(f"{base}/reset_prefix_cache?model=a", headers=ADMIN_AUTH)
    assert again.status_code == 200 and again.json()["pool_blocks"] == 0, again.text
    assert httpx.post(f"{base}/reset_prefix_cache?model=gpt-5", headers=ADMIN_AUTH).status_code == 404
    assert generate(base, "a", PROMPTS[0]) == alone[("a", PROMPTS[0])]  # computed again, same answer
    metrics = httpx.get(f"{base}/metrics", headers=ADMIN_AUTH).text
    generated = {
        model: float(line.split()[-1])
        for model in ("a", "b")
        for line in metrics.splitlines()
        if line.startswith(f'llm_serving_generated_tokens_total{{model="{model}"}}')
    }
    assert generated["a"] > 0 and generated["b"] > 0


def test_gemma_chats_calls_tools_and_follows_a_schema_through_the_openai_api(stack):
    """Model b is Gemma-shaped and its file has no chat template: the one shipped for Gemma renders
    the messages (its turns' control tokens are what the model reads); a required tool call and a
    JSON Schema are followed token by token through its SentencePiece vocabulary."""
    base, url = stack["base"], f"{stack['base']}/v1/chat/completions"
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    tokenized = httpx.post(
        f"{base}/tokenize", json={"model": "b", "messages": messages}, headers=AUTH, timeout=TIMEOUT
    )
    assert tokenized.status_code == 200, tokenized.text
    assert tokenized.json()["tokens"][:2] == [2, 105]  # <bos> <start_of_turn>
    chat = httpx.post(
        url, json={"model": "b", "messages": messages, "max_tokens": 8}, headers=AUTH, timeout=TIMEOUT
    )
    assert chat.status_code == 200 and chat.json()["choices"][0]["message"]["role"] == "assistant", chat.text
    weather = {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"enum": ["Paris", "Rome"]}},  # short: a random model's call ends
                "required": ["city"],
                "additionalProperties": False,
            },
        },
    }
    called = httpx.post(
        url,
        json={
            "model": "b",
            "messages": messages,
            "tools": [weather],
            "tool_choice": "required",
            "max_tokens": 96,  # the tiny vocabulary spells JSON a character at a time
        },
        headers=AUTH,
        timeout=TIMEOUT,
    ).json()
    assert "tool_calls" in called["choices"][0]["message"], called
    calls = called["choices"][0]["message"]["tool_calls"]
    assert calls and calls[0]["function"]["name"] == "get_weather", called
    assert json.loads(calls[0]["function"]["arguments"])["city"] in ("Paris", "Rome")
    schema = {
        "type": "object",
        "properties": {"n": {"enum": [1, 2, 3]}},
        "required": ["n"],
        "additionalProperties": False,
    }
    shaped = httpx.post(
        url,
        json={
            "model": "b",
            "messages": messages,
            "max_tokens": 64,
            "response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": schema}},
        },
        headers=AUTH,
        timeout=TIMEOUT,
    ).json()
    content = shaped["choices"][0]["message"]["content"]
    assert shaped["choices"][0]["finish_reason"] == "stop", shaped
    assert json.loads(content)["n"] in (1, 2, 3)


def test_tritonclient_sees_the_repository_and_infers_on_both(stack):
    import numpy as np

    base = stack["base"]
    client = triton.InferenceServerClient(base.removeprefix("http://"))
    # tritonclient writes its own headers into the dict it is given: each call gets a copy.
    assert {m["name"]: m["state"] for m in client.get_model_repository_index(headers=dict(AUTH))}[
        "b"
    ] == "READY"
    want = {m: generate(base, m, PROMPTS[1], 8) for m in ("a", "b")}

    def infer(model: str) -> str:
        text = triton.InferInput("text_input", [1], "BYTES")
        text.set_data_from_numpy(np.array([PROMPTS[1].encode()], dtype=object))
        tokens = triton.InferInput("max_tokens", [1], "INT32")
        tokens.set_data_from_numpy(np.array([8], np.int32))
        greedy = triton.InferInput("temperature", [1], "FP32")
        greedy.set_data_from_numpy(np.array([0.0], np.float32))
        [out] = client.infer(model, [text, tokens, greedy], headers=dict(AUTH)).as_numpy("text_output")
        return out.decode() if isinstance(out, bytes) else out

    assert {m: infer(m) for m in ("a", "b")} == want
    client.unload_model("b", headers=dict(ADMIN_AUTH))
    assert not client.is_model_ready("b", headers=dict(AUTH)) and client.is_model_ready(
        "a", headers=dict(AUTH)
    )
    with pytest.raises(InferenceServerException, match="UNAVAILABLE"):
        infer("b")
    client.load_model("b", headers=dict(ADMIN_AUTH))
    assert client.is_model_ready("b", headers=dict(AUTH)) and infer("b") == want["b"]
    with pytest.raises(InferenceServerException, match="admin key"):
        client.unload_model("b", headers=dict(AUTH))
    client.close()


def test_unload_under_load_drains_it_and_leaves_the_other_alone(stack):
    base, launcher = stack["base"], stack["launcher"]
    long_a = {p: stream(base, "a", p, 200, ignore_eos=True) for p in PROMPTS[:2]}
    b_before = {p: generate(base, "b", p) for p in PROMPTS}
    b_pids = launcher_status(stack["control"])["b"]["pids"]
    a_pids = launcher_status(stack["control"])["a"]["pids"]
    assert b_pids and all(alive(pid) for pid in b_pids)
    rss_before = tree_rss_mb(launcher)

    results: dict = {}

    def run(key, fn, *args, **kwargs):
        results[key] = fn(*args, **kwargs)

    threads = [
        threading.Thread(target=run, args=(("a", p), stream, base, "a", p, 200), kwargs={"ignore_eos": True})
        for p in long_a
    ]
    threads += [
        threading.Thread(
            target=run, args=(("b", i), stream, base, "b", PROMPTS[i], 480), kwargs={"ignore_eos": True}
        )
        for i in range(4)
    ]
    for thread in threads:
        thread.start()
    wait_until(
        lambda: '"data": 4' in httpx.get(f"{base}/serving/get_bs?model=b", headers=AUTH).text,
        30,
        "b's 4 streams running",
        poll_s=0.02,
    )
    unloading = threading.Thread(target=run, args=("unload", unload, base, "b"))
    unloading.start()
    refusals = []
    while unloading.is_alive():  # a client asking again and again while the model unloads
        reply = httpx.post(f"{base}/models/b/generate", json=body("x"), headers=AUTH, timeout=TIMEOUT)
        refusals.append((reply.status_code, reply.json().get("error")))
        time.sleep(0.02)
    for thread in [unloading, *threads]:
        thread.join(TIMEOUT)
    assert results["unload"].status_code == 200, results["unload"].text

    # the unloaded model's streams finished, or ended with an error event naming the unload
    for i in range(4):
        events = results[("b", i)]
        last = events[-1]
        if last["event"] == "error":
            assert last["data"] == "model 'b' is being unloaded"
        else:
            assert len(events) >= 100, events[-3:]
    # answered until the unload began (its request on its way), then refused
    statuses = [status for status, _ in refusals]
    assert 503 in statuses and set(statuses[statuses.index(503) :]) == {503}, refusals
    assert any(message == "model 'b' is UNLOADING" for _, message in refusals), refusals
    # the other model's streams are untouched: the same answers, no error (their events may cut the
    # text elsewhere: speculation keeps more or fewer tokens a step under load)
    for p, events in long_a.items():
        got = results[("a", p)]
        assert all(e["event"] == "message" for e in got), got[-3:]
        assert "".join(e["data"] for e in got) == "".join(e["data"] for e in events)
    assert not wait_gone(b_pids, 10), "the unloaded model's agents still run"
    assert all(alive(pid) for pid in a_pids) and launcher_status(stack["control"])["a"]["pids"] == a_pids
    assert tree_rss_mb(launcher) < rss_before - 50, (rss_before, tree_rss_mb(launcher))
    after = httpx.post(f"{base}/models/b/generate", json=body("x"), headers=AUTH)
    assert after.status_code == 503 and after.json()["error"] == "model 'b' is UNAVAILABLE (unloaded)"
    assert unload(base, "b").status_code == 200  # idempotent

    assert load(base, "b").status_code == 200
    assert {p: generate(base, "b", p) for p in PROMPTS} == b_before


def test_a_load_that_cannot_fit_or_fails_leaves_it_unavailable_and_the_others_serving(stack):
    base = stack["base"]
    a_before, b_before = generate(base, "a", PROMPTS[2]), generate(base, "b", PROMPTS[2])
    pids = {m: launcher_status(stack["control"])[m]["pids"] for m in ("a", "b")}

    too_big = load(base, "big")
    assert too_big.status_code == 400
    reason = index(base)["big"]["reason"]
    assert "needs 100 MB" in reason and f"{LIMIT_MB - 2 * BUDGET_MB} MB of agents.memory_limit_mb" in reason
    assert reason in too_big.json()["error"] and index(base)["big"]["state"] == "UNAVAILABLE"

    failed = load(base, "broken")
    assert failed.status_code == 400
    broken = index(base)["broken"]
    assert broken["state"] == "UNAVAILABLE" and "agent rank 0 failed to start" in broken["reason"]
    assert "last lines of" in broken["reason"] and "corrupt.gguf" in broken["reason"]
    assert launcher_status(stack["control"])["broken"] == {
        "state": "UNAVAILABLE",
        "reason": broken["reason"],
        "pids": [],
        "memory_mb": None,
    }
    retry = httpx.post(f"{base}/models/broken/generate", json=body("x"), headers=AUTH)
    assert retry.status_code == 503 and "UNAVAILABLE (agent rank 0 failed to start" in retry.json()["error"]

    assert generate(base, "a", PROMPTS[2]) == a_before and generate(base, "b", PROMPTS[2]) == b_before
    assert {m: launcher_status(stack["control"])[m]["pids"] for m in ("a", "b")} == pids
    assert httpx.get(f"{base}/ready", headers=AUTH).status_code == 200


@pytest.mark.parametrize(
    "method, path, payload, status, words",
    [
        ("POST", "/v2/repository/models/nope/load", None, 404, "served: a, alpha"),
        ("POST", "/v2/repository/models/nope/unload", None, 404, "served: a, alpha"),
        ("POST", "/v2/repository/models/a/load", "{not json", 400, "not valid JSON"),
        ("POST", "/v2/repository/models/a/load", '{"parameters": {"config": "{}"}}', 400, "config"),
        (
            "POST",
            "/v2/repository/models/a/unload",
            '{"parameters": {"unload_dependents": 3}}',
            400,
            "unload_dependents",
        ),
        ("POST", "/v2/repository/index", '{"ready": "sometimes"}', 400, "ready"),
        ("GET", "/v2/repository/models/a/load", None, 405, "Method Not Allowed"),
        ("GET", "/serving/get_bs?model=nope", None, 404, "served: a, alpha"),
        ("GET", "/serving/get_bs?group=0", None, 400, "group needs model=NAME"),
        ("GET", "/serving/get_bs?model=a&group=3", None, 400, "group 3 does not exist"),
        ("GET", "/serving/get_request_numbers?model=nope", None, 404, "served: a, alpha"),
        ("GET", "/v2/models/nope/ready", None, 404, "served: a, alpha"),
        ("GET", "/v2/models/big/ready", None, 503, "model 'big' is not ready: UNAVAILABLE"),
        ("POST", "/tokenize", '{"model": "big", "prompt": "x"}', 503, "model 'big' is UNAVAILABLE"),
    ],
)
def test_bad_repository_requests_get_a_defined_status(stack, method, path, payload, status, words):
    headers = ADMIN_AUTH if "repository/models" in path else AUTH
    reply = httpx.request(method, stack["base"] + path, content=payload, headers=headers, timeout=TIMEOUT)
    assert reply.status_code == status, reply.text
    error = reply.json()["error"]
    assert words in (error if isinstance(error, str) else error["message"]), error


def test_batch_and_queue_by_model(stack):
    base = stack["base"]

    def value(path: str) -> int:
        """The one SSE event's value, checked to be framed as without ?model= (byte for byte)."""
        text = httpx.get(base + path, headers=AUTH).text
        number = text.split()[-1].rstrip("}")
        assert text.strip() == f'data: {{"event": "message", "retry": 30000, "data": {number}}}', text
        return int(number)

    assert (
        value("/serving/get_bs") == value("/serving/get_bs?model=a") == value("/serving/get_bs?model=b") == 0
    )
    assert value("/serving/get_request_numbers?model=alpha") == value("/serving/get_bs?model=big") == 0
    assert value("/serving/get_bs?model=a&group=0") == 0
    ready = index(base)
    assert httpx.post(f"{base}/v2/repository/index", json={"ready": True}, headers=AUTH).json() == [
        m for m in ready.values() if m["state"] == "READY"
    ]


def test_sigterm_to_the_server_and_the_launcher_with_two_models_loaded(stack):
    """A new server between the two takes over both models, b (loaded on request) included."""
    base, launcher, server = stack["base"], stack["launcher"], stack["server"]
    assert {n for n, m in index(base).items() if m["state"] == "READY"} == {"a", "b"}
    answers = {m: generate(base, m, PROMPTS[3]) for m in ("a", "b")}
    pids = launcher.descendant_pids()
    assert len(launcher.agent_pids()) == 2
    assert supervised_stop(server.process, grace_s=30) == ("exited", 0)
    assert all(alive(pid) for pid in launcher.agent_pids())  # the agents outlive the server
    successor = LauncherProcess(server.config_path, script="start_server.py")
    try:
        successor.wait_for("Application startup complete", 120)
        successor.wait_for("model b ready", 60)
        assert {m: generate(base, m, PROMPTS[3]) for m in ("a", "b")} == answers
        assert supervised_stop(successor.process, grace_s=30) == ("exited", 0)
    finally:
        successor.close()
    assert launcher.descendant_pids() == pids
    assert supervised_stop(launcher.process, grace_s=30) == ("exited", 0)
    assert not wait_gone(pids, 10), "processes left running"
    output = launcher.output()
    assert "a: all agents stopped" in output and "b: all agents stopped" in output
    assert "Traceback" not in output + server.output()
