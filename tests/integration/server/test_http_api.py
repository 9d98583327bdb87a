"""The HTTP front end on the tiny model: real agent, real `start_server.py` under uvicorn, real HTTP
clients (httpx, and httpx-sse as the SSE client)."""

import json
import signal
import threading
import time

import httpx
import pytest

from agent_harness import LONG_ANSWERS_RUNTIME, free_ports, serving_stack, write_config
from http_client import answer_three_ways, data_lines, one_event, post
from waiting import wait_until

TEXTS = ["The quick brown fox", "你好，世界！ 东京", "emoji 😀 🎉 and\nnewlines\n\n"]
DRAIN_TIMEOUT_S = 60


@pytest.fixture(scope="module")
def stack(tmp_path_factory, tiny_llama_dir):
    """Agent + server on the tiny model, 8 slots and room for long answers; yields (base URL, server).
    The queue holds 512: the benchmark test's background feed sends a prompt every 20 ms for as
    long as its run lasts, which on a busy 2-core machine queued more than 64 (the default: 503s)."""
    agent_port, http_port = free_ports(2)
    path = write_config(
        tmp_path_factory.mktemp("http"),
        tiny_llama_dir,
        [agent_port],
        runtime=LONG_ANSWERS_RUNTIME,
        server={"port": http_port, "drain_timeout_s": DRAIN_TIMEOUT_S},
        scheduler={"max_waiting_requests": 512},
    )
    with serving_stack(path) as (_agents, server):
        yield f"http://127.0.0.1:{http_port}", server


@pytest.mark.parametrize("text", TEXTS)
def test_three_styles_give_the_same_text(stack, text):
    base, _ = stack
    full, sse, plain = answer_three_ways(base, "tiny", text, {"max_new_tokens": 16})
    assert full and full == sse == plain


def test_plain_protocol_sends_a_line_per_token(stack):
    """A never-matching stop string holds the text back, so most tokens complete no text yet: each
    still gets its line (empty text), indexed by token, and the texts join to the whole answer."""
    base, _ = stack
    parameters = {"max_new_tokens": 24, "ignore_eos": True, "stop": ["\u2603" * 200]}
    full = post(f"{base}/models/tiny/generate", {"inputs": TEXTS[0], "parameters": parameters})
    lines = data_lines(
        f"{base}/models/tiny",
        {"inputs": TEXTS[0], "stream": True, "parameters": {**parameters, "return_protocol": "plain"}},
    )
    tokens = [line["token"] for line in lines]
    assert [t["index"] for t in tokens] == list(range(24))
    assert all(isinstance(t["id"], int) for t in tokens)
    assert any(t["text"] == "" for t in tokens), "the stop string held nothing back"
    assert "".join(t["text"] for t in tokens) == full.json()["generated_text"]


class TimedStream(threading.Thread):
    """A streaming client that records when its first and last pieces arrived."""

    def __init__(self, base: str, inputs: str, max_new_tokens: int):
        super().__init__()
        self.url, self.body = (
            f"{base}/models/tiny/generate_stream",
            {
                "inputs": inputs,
                "stream": True,
                "parameters": {"max_new_tokens": max_new_tokens, "return_protocol": "plain"},
            },
        )
        self.pieces: list[dict] = []
        self.first = self.last = None

    def run(self):
        with httpx.stream("POST", self.url, json=self.body, timeout=120) as response:
            for line in response.iter_lines():
                if line:
                    self.pieces.append(json.loads(line[len("data:") :]))
                    self.first = self.first or time.monotonic()
        self.last = time.monotonic()

    @property
    def text(self) -> str:
        return "".join(p["token"]["text"] for p in self.pieces if "token" in p)


def test_continuous_batching_over_http(stack):
    """8 streams: late ones start while early ones decode, get_bs sees the batch, and every answer
    equals the answer it gets alone."""
    base, _ = stack
    early_prompts = [f"The quick brown fox {i}" for i in range(4)]
    late_prompts = [f"你好 {i}" for i in range(4)]
    alone = {
        p: post(f"{base}/models/tiny/generate", {"inputs": p, "parameters": {"max_new_tokens": n}}).json()[
            "generated_text"
        ]
        for p, n in [*((p, 300) for p in early_prompts), *((p, 20) for p in late_prompts)]
    }

    early = [TimedStream(base, p, 300) for p in early_prompts]
    for s in early:
        s.start()
    wait_until(lambda: all(s.first for s in early), 60, "a token of every early stream", poll_s=0.01)
    late = [TimedStream(base, p, 20) for p in late_prompts]
    for s in late:
        s.start()
    batch_sizes = []
    while any(s.is_alive() for s in early + late):
        batch_sizes.append(one_event(f"{base}/serving/get_bs"))
        assert one_event(f"{base}/serving/get_request_numbers") >= 0
    for s in early + late:
        s.join()
    assert max(batch_sizes) > 1
    assert max(s.first for s in late) < min(s.last for s in early)  # joined the running batch
    assert {s.body["inputs"]: s.text for s in early + late} == alone
    assert one_event(f"{base}/serving/get_bs") == 0


def test_disconnect_frees_the_slot(stack):
    base, _ = stack
    with httpx.stream(
        "POST",
        f"{base}/models/tiny/generate_stream",
        timeout=60,
        json={"inputs": "The quick", "parameters": {"max_new_tokens": 300}},
    ) as r:
        lines = r.iter_lines()  # kept: a dropped iterator closes the connection at once
        next(lines)
        assert one_event(f"{base}/serving/get_bs") == 1
    wait_until(lambda: one_event(f"{base}/serving/get_bs") == 0, 10, "the slot freed")


@pytest.mark.parametrize(
    "body, status, message",
    [
        (b"{not json", 400, "not valid JSON"),
        (b"[1, 2]", 422, "body"),
        ({"parameters": {}}, 422, "inputs: Field required"),
        ({"inputs": 5}, 422, "inputs"),
        ({"inputs": "x", "parameters": {"max_new_tokens": -1}}, 422, "parameters.max_new_tokens"),
        ({"inputs": "x", "parameters": {"top_p": "high"}}, 422, "parameters.top_p"),
        ({"inputs": "x", "parameters": {"bogus": 1}}, 422, "parameters.bogus"),
        ({"inputs": "word " * 600}, 413, "the longest accepted is 511"),
        ({"inputs": ""}, 400, "empty"),
    ],
)
def test_bad_input_gets_a_json_error_and_the_server_keeps_serving(stack, body, status, message):
    base, _ = stack
    url = f"{base}/models/tiny/generate"
    response = (
        httpx.post(url, content=body, headers={"content-type": "application/json"})
        if isinstance(body, bytes)
        else post(url, body)
    )
    assert response.status_code == status and message in response.json()["error"], response.text
    assert post(url, {"inputs": "ok", "parameters": {"max_new_tokens": 2}}).status_code == 200


def test_a_body_sent_as_curl_sends_it_is_read_as_json(stack):
    """`curl -d '{...}'` labels the body form-urlencoded; it is still the JSON request."""
    base, _ = stack
    response = httpx.post(
        f"{base}/models/tiny/generate",
        content=b'{"inputs": "The quick"}',
        headers={"content-type": "application/x-www-form-urlencoded"},
        timeout=60,
    )
    assert response.status_code == 200 and response.json()["generated_text"]


def test_unknown_model_is_404_listing_the_served_names(stack):
    base, _ = stack
    response = post(f"{base}/models/gpt-5/generate", {"inputs": "x"})
    assert response.status_code == 404 and "served: tiny" in response.json()["error"]


def test_benchmark_tool_runs_against_the_server(stack, tmp_path):
    """A short real run of `python -m tools.bench` (no speed assert): ignore_eos makes every
    request stream its full length; the report files appear."""
    base, _ = stack
    from tools.bench.__main__ import main

    code = main(
        [
            "--target",
            f"tiny={base}/models/tiny",
            "--concurrency",
            "1,2",
            "--requests",
            "2",
            "--output-len",
            "12",
            "--settle",
            "0",
            "--warmup",
            "1",
            "--out",
            str(tmp_path),
            "--name",
            "run",
            "--prompts",
            str(write_prompts(tmp_path)),
        ]
    )
    assert code == 0
    written = json.loads((tmp_path / "run.json").read_text())
    assert "; kernels: " in written["settings"]["machine"]  # the CPU and the kernel target
    results = written["results"]
    assert [(r["target"], r["level"]) for r in results] == [("tiny", 1), ("tiny", 2)]
    for r in results:
        s = r["summary"]
        assert s["errors"] == 0 and s["requests"] == 2 and s["ttft_p50_s"] > 0
        assert 2 <= s["output_tokens"] <= 2 * 12 and s["output_tok_s"] > 0
    assert (tmp_path / "run.png").stat().st_size > 0 and "| tiny | 2 |" in (tmp_path / "run.md").read_text()

    # Decoding streams under a steady stream of long prompts, reported apart.
    code = main(
        [
            "--target",
            f"tiny={base}/models/tiny",
            "--concurrency",
            "2",
            "--requests",
            "8",
            "--output-len",
            "20",
            "--settle",
            "0",
            "--warmup",
            "0",
            "--background-words",
            "6",
            "--background-interval",
            "0.02",
            "--out",
            str(tmp_path),
            "--name",
            "mixed",
            "--prompts",
            str(write_prompts(tmp_path)),
        ]
    )
    assert code == 0
    s = json.loads((tmp_path / "mixed.json").read_text())["results"][0]["summary"]
    assert s["requests"] == 8 and s["errors"] == 0 and 0 < s["output_tokens"] <= 8 * 20
    # an interval far below the run's length (the tiny model ends 8 answers in ~0.1 s): a first
    # prompt at 0.2 s / 2 came after a fast run had ended
    assert s["background_requests"] >= 1 and s["background_errors"] == 0 and s["background_ttft_p50_s"] > 0
    # the first arrives after half an interval: the window's count is its length over the interval,
    # rounded (starting at once would add one)
    assert s["background_requests"] <= s["wall_s"] / 0.02 + 0.5
    assert s["background_per_min"] == pytest.approx(60 * s["background_requests"] / s["wall_s"])
    assert "| prompts | per minute |" in (tmp_path / "mixed.md").read_text()


def write_prompts(directory):
    """Short prompts: the tiny model's prompt limit is 64 tokens."""
    path = directory / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in TEXTS))
    return path


def test_sigterm_drains_running_streams_then_exits_0(stack):
    """Last in this module. Streams admitted before SIGTERM run to their end; a request that
    arrives during the drain gets 503; the process exits 0."""
    base, server = stack
    want = {
        f"drain {i}": post(
            f"{base}/models/tiny/generate", {"inputs": f"drain {i}", "parameters": {"max_new_tokens": 300}}
        ).json()["generated_text"]
        for i in range(4)
    }
    streams = [TimedStream(base, p, 300) for p in want]
    for s in streams:
        s.start()
    wait_until(lambda: all(s.first for s in streams), 60, "a token of every stream", poll_s=0.01)
    server.process.send_signal(signal.SIGTERM)
    server.wait_for("refusing new requests, draining", 10)
    refused = post(f"{base}/models/tiny/generate", {"inputs": "late", "parameters": {"max_new_tokens": 2}})
    assert refused.status_code == 503 and "shutting down" in refused.json()["error"]
    assert refused.headers["retry-after"]
    for s in streams:
        s.join()
    assert {s.body["inputs"]: s.text for s in streams} == want
    assert server.process.wait(DRAIN_TIMEOUT_S) == 0
    assert "draining 4 request(s)" in server.output()
