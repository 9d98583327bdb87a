"""The HTTP front end: real agent, real `start_server.py` under uvicorn, real HTTP clients."""
import json
import signal
import threading

import httpx
import pytest

from agent_harness import LauncherProcess, free_ports, write_config
from config import load_config

TEXTS = ["The quick brown fox", "你好，世界！ 东京", "emoji 😀 🎉 and\nnewlines\n\n"]


@pytest.fixture(scope="module")
def stack(tmp_path_factory, tiny_llama_dir):
    """Agent + server on the tiny model; yields (base URL, config, server process)."""
    agent_port, http_port = free_ports(2)
    directory = tmp_path_factory.mktemp("http")
    path = write_config(directory, tiny_llama_dir, [agent_port],
                        server={"port": http_port, "max_waiting_requests": 8})
    agents = LauncherProcess(path)
    server = None
    try:
        agents.wait_for("all agents started", 240)
        server = LauncherProcess(path, script="start_server.py")
        server.wait_for("Application startup complete", 120)
        yield f"http://127.0.0.1:{http_port}", load_config(path), server
    finally:
        if server is not None:
            server.close()
        agents.close()


def post(url, body, **kw):
    return httpx.post(url, json=body, timeout=60, **kw)


def sse_data(response_text: str) -> list[dict]:
    """The JSON payload of every SSE event (line parsing as an SSE client does)."""
    events = [e for e in response_text.replace("\r\n", "\n").split("\n\n") if e.strip()]
    out = []
    for event in events:
        data = [line[len("data:"):].lstrip(" ") for line in event.split("\n") if line.startswith("data:")]
        if data:
            out.append(json.loads("\n".join(data)))
    return out


@pytest.mark.parametrize("text", TEXTS)
def test_three_styles_give_the_same_text(stack, text):
    base, _, _ = stack
    params = {"max_new_tokens": 16}
    full = post(f"{base}/models/tiny/generate", {"inputs": text, "parameters": params})
    assert full.status_code == 200 and full.text.endswith("\n") and full.text.count("\n") == 1
    answer = full.json()["generated_text"]
    assert answer
    assert post(f"{base}/models/tiny", {"inputs": text, "parameters": params}).json() == full.json()

    sse = post(f"{base}/models/tiny/generate_stream",
               {"inputs": text, "parameters": {**params, "return_full_text": True}})
    assert sse.headers["content-type"].startswith("text/event-stream")
    events = sse_data(sse.text)
    assert all(e["event"] == "message" and e["retry"] == 30000 for e in events)
    assert "".join(e["data"] for e in events[:-1]) == answer and events[-1]["data"] == answer

    plain = post(f"{base}/models/tiny", {"inputs": text, "stream": True, "parameters": {
        **params, "return_protocol": "plain", "return_full_text": True}})
    lines = [json.loads(line[len("data:"):]) for line in plain.text.splitlines()]
    tokens = [line["token"] for line in lines[:-1]]
    assert [t["index"] for t in tokens] == list(range(len(tokens)))
    assert "".join(t["text"] for t in tokens) == answer
    assert lines[-1] == {"generated_text": answer}


def test_get_bs_and_request_numbers_while_streams_run(stack):
    base, _, _ = stack
    seen = []

    def stream(i):
        with httpx.stream("POST", f"{base}/models/tiny/generate_stream", timeout=60,
                          json={"inputs": f"The quick {i}", "parameters": {"max_new_tokens": 40}}) as r:
            for _ in r.iter_lines():
                pass

    workers = [threading.Thread(target=stream, args=(i,)) for i in range(6)]
    for w in workers:
        w.start()
    while any(w.is_alive() for w in workers):
        bs = sse_data(httpx.get(f"{base}/serving/get_bs", timeout=10).text)
        queue = sse_data(httpx.get(f"{base}/serving/get_request_numbers", timeout=10).text)
        assert len(bs) == 1 and bs[0]["event"] == "message" and bs[0]["retry"] == 30000
        seen.append((bs[0]["data"], queue[0]["data"]))
    for w in workers:
        w.join()
    assert max(b for b, _ in seen) > 1  # continuous batching: several sequences in one batch
    final = sse_data(httpx.get(f"{base}/serving/get_bs", timeout=10).text)
    assert final[0]["data"] == 0


def test_disconnect_frees_the_slot(stack):
    base, _, _ = stack
    with httpx.stream("POST", f"{base}/models/tiny/generate_stream", timeout=60,
                      json={"inputs": "The quick", "parameters": {"max_new_tokens": 60}}) as r:
        next(r.iter_lines())
    for _ in range(100):
        if sse_data(httpx.get(f"{base}/serving/get_bs", timeout=10).text)[0]["data"] == 0:
            break
        threading.Event().wait(0.05)
    assert sse_data(httpx.get(f"{base}/serving/get_bs", timeout=10).text)[0]["data"] == 0


@pytest.mark.parametrize("body, status, message", [
    (b"{not json", 400, "not valid JSON"),
    ({"parameters": {}}, 422, "inputs: Field required"),
    ({"inputs": 5}, 422, "inputs"),
    ({"inputs": "x", "parameters": {"max_new_tokens": -1}}, 422, "parameters.max_new_tokens"),
    ({"inputs": "x", "parameters": {"bogus": 1}}, 422, "parameters.bogus"),
    ({"inputs": "word " * 80}, 413, "the longest accepted is 64"),
    ({"inputs": ""}, 400, "empty"),
])
def test_bad_input_gets_a_json_error_and_the_server_keeps_serving(stack, body, status, message):
    base, _, _ = stack
    url = f"{base}/models/tiny/generate"
    response = (httpx.post(url, content=body, headers={"content-type": "application/json"})
                if isinstance(body, bytes) else post(url, body))
    assert response.status_code == status and message in response.json()["error"], response.text
    assert post(url, {"inputs": "ok", "parameters": {"max_new_tokens": 2}}).status_code == 200


def test_unknown_model_is_404_listing_the_served_names(stack):
    base, _, _ = stack
    response = post(f"{base}/models/gpt-5/generate", {"inputs": "x"})
    assert response.status_code == 404 and "served: tiny" in response.json()["error"]


def test_sigterm_ends_the_server_cleanly(stack):
    """Last in this module: the server stops; the agents stay up."""
    base, _, server = stack
    server.process.send_signal(signal.SIGTERM)
    assert server.process.wait(30) == 0
