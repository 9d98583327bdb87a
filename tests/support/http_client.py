"""Test-side HTTP helpers: the three ways to ask the native API for an answer, each parsed the way
its clients parse it (a real SSE client, `data:` line parsing, plain JSON)."""

from __future__ import annotations

import json

import httpx
from httpx_sse import connect_sse
from prometheus_client.parser import text_string_to_metric_families

TIMEOUT = 120


def post(url: str, body, **kw) -> httpx.Response:
    return httpx.post(url, json=body, timeout=TIMEOUT, **kw)


def one_event(url: str) -> int:
    """The value a /serving/ endpoint reports, read with the SSE client."""
    with httpx.Client(timeout=TIMEOUT) as client, connect_sse(client, "GET", url) as source:
        events = [json.loads(e.data) for e in source.iter_sse()]
    assert len(events) == 1 and events[0]["event"] == "message" and events[0]["retry"] == 30000, events
    return events[0]["data"]


def sse_messages(url: str, body: dict) -> list[dict]:
    """Every event of a streamed answer (return_protocol "sse"), read with the SSE client."""
    with httpx.Client(timeout=TIMEOUT) as client, connect_sse(client, "POST", url, json=body) as source:
        assert source.response.status_code == 200, source.response.read()
        return [json.loads(e.data) for e in source.iter_sse()]


def data_lines(url: str, body: dict) -> list[dict]:
    """Every line of a streamed answer in the plain protocol (`data:{json}` per line)."""
    response = post(url, body)
    assert response.status_code == 200, response.text
    lines = response.text.splitlines()
    assert all(line.startswith("data:") for line in lines), lines
    return [json.loads(line[len("data:") :]) for line in lines]


def answer_three_ways(base: str, model: str, inputs: str, parameters: dict) -> tuple[str, str, str]:
    """(non-stream text, SSE pieces joined, plain-line pieces joined); also checks each protocol's
    framing and that its return_full_text event equals its joined pieces."""
    full = post(f"{base}/models/{model}/generate", {"inputs": inputs, "parameters": parameters})
    assert full.status_code == 200 and full.text.endswith("\n") and full.text.count("\n") == 1, full.text
    text = full.json()["generated_text"]
    assert post(f"{base}/models/{model}", {"inputs": inputs, "parameters": parameters}).json() == full.json()

    events = sse_messages(
        f"{base}/models/{model}/generate_stream",
        {"inputs": inputs, "parameters": {**parameters, "return_full_text": True}},
    )
    assert all(e["event"] == "message" and e["retry"] == 30000 for e in events), events
    sse_text = "".join(e["data"] for e in events[:-1])
    assert events[-1]["data"] == sse_text

    lines = data_lines(
        f"{base}/models/{model}",
        {
            "inputs": inputs,
            "stream": True,
            "parameters": {**parameters, "return_protocol": "plain", "return_full_text": True},
        },
    )
    tokens = [line["token"] for line in lines[:-1]]
    assert [t["index"] for t in tokens] == list(range(len(tokens)))
    plain_text = "".join(t["text"] for t in tokens)
    assert lines[-1] == {"generated_text": plain_text}
    return text, sse_text, plain_text


def aborted_requests(base: str, headers: dict | None = None) -> float:
    """The server's count of answers aborted (their client gone or stalled), from /metrics."""
    text = httpx.get(f"{base}/metrics", headers=headers, timeout=TIMEOUT).text
    return next(
        s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if s.name == "llm_serving_requests_total" and s.labels.get("outcome") == "aborted"
    )


def greedy_completions(
    base: str, prompts: list[list[int]], max_tokens: int, model: str = "tiny"
) -> list[str]:
    """Each token-id prompt's /v1/completions text at temperature 0, `max_tokens` long (EOS ignored)."""
    texts = []
    for prompt in prompts:
        body = {
            "model": model,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
        }
        reply = httpx.post(f"{base}/v1/completions", json=body, timeout=TIMEOUT)
        assert reply.status_code == 200, reply.text
        texts.append(reply.json()["choices"][0]["text"])
    return texts
