"""One request never fails another's, freezes the server or takes every slot: hostile requests
against a real agent and a real `start_server.py` on the tiny model, each beside a victim whose
exact answer (greedy, computed alone first) must come out unchanged.

- sampling numerics: a temperature of 1e-300 with logprobs is greedy with finite logprobs (it made
  the agent send NaN, which failed the whole agent group); penalties out of bounds are refused;
- a grammar that leaves nothing to sample after its first token (min_tokens keeps out all it
  allows) ends only its own sequence, with a 400;
- bounded replies, grammars and compile times; 400s instead of 500s for malformed values;
- Triton's endpoints stop generating when the client goes;
- fairness: a client flooding with requests of its key cannot lock another out, which gets the
  next free slot; a client that stops reading is dropped and its slot freed.
"""

import json
import math
import socket
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from agent.model.tokenizer import load_tokenizer
from agent_harness import (
    LONG_ANSWERS_RUNTIME,
    free_ports,
    serving_stack,
    thread_cpu_seconds,
    worker_thread_busy,
    write_config,
)
from http_client import aborted_requests
from server.structured_output import Grammars, GrammarSpec
from waiting import wait_until

VICTIM_KEY, ATTACKER_KEY = "victim-key", "attacker-key"
# Room for answers of 2000 tokens: a stalled client's answer must outgrow every buffer between the
# server and the client (the kernel's send buffer alone grows to 4 MB).
RUNTIME = {**LONG_ANSWERS_RUNTIME, "max_seq_len": 2048, "attend_buckets": [64, 512, 2048]}
SLOTS = RUNTIME["num_slots"]
MAX_WAITING = 4
GRAMMAR_TIMEOUT_S = 0.3
MAX_GRAMMAR_BYTES = 900_000  # room for a grammar slow to compile on a fast CPU (under the body limit)
STREAM_WRITE_TIMEOUT_S = 1.0
MAX_REPLY_LOGPROBS = 2000
VICTIM_PROMPT = "The capital of France is"


def auth(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture(scope="module")
def stack(tmp_path_factory, tiny_llama_dir):
    """Agent + server on the tiny model with two API keys; yields (base URL, http port, server pid)."""
    agent_port, http_port = free_ports(2)
    path = write_config(
        tmp_path_factory.mktemp("hostile"),
        tiny_llama_dir,
        [agent_port],
        runtime=RUNTIME,
        server={
            "port": http_port,
            "api_keys": [VICTIM_KEY, ATTACKER_KEY],
            "grammar_compile_timeout_s": GRAMMAR_TIMEOUT_S,
            "max_grammar_bytes": MAX_GRAMMAR_BYTES,
            "stream_write_timeout_s": STREAM_WRITE_TIMEOUT_S,
            "max_reply_logprobs": MAX_REPLY_LOGPROBS,
        },
        scheduler={"max_waiting_requests": MAX_WAITING, "client_share": 0.5},
    )
    with serving_stack(path) as (_agents, server):
        yield f"http://127.0.0.1:{http_port}", http_port, server.process.pid


def completion(base: str, key: str = VICTIM_KEY, **body) -> httpx.Response:
    body = {"model": "tiny", "prompt": VICTIM_PROMPT, "max_tokens": 8, "temperature": 0, **body}
    return httpx.post(f"{base}/v1/completions", json=body, headers=auth(key), timeout=120)


def long_answer(tokens: int = 300) -> dict:
    return {
        "inputs": VICTIM_PROMPT,
        "parameters": {"max_new_tokens": tokens, "ignore_eos": True, "return_protocol": "plain"},
    }


def stream_text(base: str, body: dict, key: str, seen: list | None = None, name: str = "") -> str:
    """A native plain-protocol stream's text; an error line fails the test. `seen`, a list the
    streams of a test share, gets (name, "admitted") once its 200 arrives (the server sends it
    after admission) and (name, "first token"): the order in which these happened."""
    text = []
    with httpx.stream(
        "POST", f"{base}/models/tiny/generate_stream", json=body, headers=auth(key), timeout=120
    ) as response:
        assert response.status_code == 200, response.read()
        if seen is not None:
            seen.append((name, "admitted"))
        for line in response.iter_lines():
            if not line:
                continue
            event = json.loads(line.removeprefix("data:"))
            assert "error" not in event, event
            if seen is not None and not text:
                seen.append((name, "first token"))
            text.append(event["token"]["text"])
    return "".join(text)


@pytest.fixture(scope="module")
def victim_alone(stack) -> str:
    base, _, _ = stack
    return stream_text(base, long_answer(), VICTIM_KEY)


def beside_victim(base: str, attack):
    """Run `attack()` while the victim's stream decodes -> (the victim's text, attack's result)."""
    seen: list = []
    with ThreadPoolExecutor(1) as pool:
        victim = pool.submit(stream_text, base, long_answer(), VICTIM_KEY, seen, "victim")
        wait_until(lambda: ("victim", "first token") in seen or victim.done(), 60, "the victim's first token")
        outcome = attack()
        return victim.result(timeout=120), outcome


def batch_size(base: str) -> int:
    text = httpx.get(f"{base}/serving/get_bs", headers=auth(VICTIM_KEY), timeout=30).text
    return json.loads(text.split("data:", 1)[1])["data"]


# ----------------------------------------------------------------------- sampling numerics


def test_a_vanishing_temperature_with_logprobs_is_greedy_beside_a_victim(stack, victim_alone):
    """On main the agent sent a NaN logprob, which the server took for a broken agent: every
    stream of the group ended with a 503, the victim's too."""
    base, _, _ = stack
    greedy = completion(base, logprobs=2).json()["choices"][0]

    def attack():
        return [
            completion(base, ATTACKER_KEY, temperature=1e-300, logprobs=2),
            httpx.post(
                f"{base}/models/tiny/generate",
                json={
                    "inputs": VICTIM_PROMPT,
                    "parameters": {
                        "do_sample": True,
                        "temperature": 1e-300,
                        "details": True,
                        "top_n_tokens": 2,
                    },
                },
                headers=auth(ATTACKER_KEY),
                timeout=120,
            ),
        ]

    text, (openai, native) = beside_victim(base, attack)
    assert text == victim_alone
    assert openai.status_code == 200, openai.text
    choice = openai.json()["choices"][0]
    assert choice["text"] == greedy["text"]
    logprobs = choice["logprobs"]["token_logprobs"]
    assert all(math.isfinite(v) for v in logprobs) and logprobs == pytest.approx(
        greedy["logprobs"]["token_logprobs"], abs=1e-4
    )
    assert native.status_code == 200, native.text
    assert all(math.isfinite(t["logprob"]) for t in native.json()["details"]["tokens"])


@pytest.mark.parametrize(
    "field, value", [("repetition_penalty", 1e-300), ("temperature", 1e9), ("repetition_penalty", 1e9)]
)
def test_sampling_values_past_their_bounds_are_refused_naming_the_field(stack, field, value):
    base, _, _ = stack
    openai = completion(base, **{field: value})
    assert openai.status_code == 400 and openai.json()["error"]["param"] == field, openai.text
    native = httpx.post(
        f"{base}/models/tiny/generate",
        json={"inputs": "hi", "parameters": {field: value}},
        headers=auth(VICTIM_KEY),
        timeout=60,
    )
    assert native.status_code == 422 and field in native.json()["error"], native.text


def test_a_grammar_that_leaves_no_token_ends_only_its_own_sequence(stack, tiny_llama_dir, victim_alone):
    """`q` then an optional `z` (regex qz?), with z among the stop ids and min_tokens 4: after
    q the grammar allows only z and EOS, both kept out. That sequence ends with a 400 saying why;
    the victim decoding in the same steps is untouched. A grammar whose very first token is kept
    out is refused at admission."""
    base, _, _ = stack
    tokenizer = load_tokenizer(tiny_llama_dir)
    (z,) = tokenizer.encode("z")
    (q,) = tokenizer.encode("q")
    body = {"structured_outputs": {"regex": "qz?"}, "min_tokens": 4, "stop_token_ids": [z], "max_tokens": 8}

    text, refused = beside_victim(base, lambda: completion(base, ATTACKER_KEY, **body))
    assert text == victim_alone
    assert refused.status_code == 400, refused.text
    assert "no token can follow" in refused.json()["error"]["message"]

    first = completion(base, **{**body, "structured_outputs": {"regex": "q"}, "stop_token_ids": [q]})
    assert first.status_code == 400 and first.json()["error"]["param"] == "min_tokens", first.text


# ------------------------------------------------------------------- bounded replies and values


def test_a_reply_with_too_many_logprob_entries_is_refused(stack):
    """n x max_tokens x (1 + top_logprobs) above server.max_reply_logprobs: 400 naming it before any
    work (on main the reply was built on the event loop, which stopped answering meanwhile)."""
    base, _, _ = stack
    body = {"n": 4, "max_tokens": 40, "logprobs": 20}  # 4 x 40 x 21 = 3360 > 2000
    refused = completion(base, **body)
    assert refused.status_code == 400 and "server.max_reply_logprobs" in refused.text, refused.text
    streamed = completion(base, **body, stream=True)
    assert streamed.status_code == 200 and streamed.text.rstrip().endswith("[DONE]")
    assert completion(base, **{**body, "n": 2, "max_tokens": 40}).status_code == 200  # 1680


@pytest.mark.parametrize(
    "path, body",
    [
        ("/v1/completions", {"model": "tiny", "prompt": "hi", "logit_bias": {"9" * 5000: 1}}),
        ("/v1/completions", {"model": "tiny", "prompt": "hi", "logit_bias": {"١٢": 1}}),
        (
            "/v2/models/tiny/infer",
            {"inputs": [{"name": "text_input", "shape": [1], "datatype": "BYTES", "data": [{"a": 1}]}]},
        ),
        ("/v2/models/tiny/generate", {"text_input": 5}),
        ("/v2/models/tiny/generate", {"text_input": ["a"]}),
    ],
    ids=[
        "logit_bias-5000-digits",
        "logit_bias-arabic-digits",
        "infer-object",
        "generate-int",
        "generate-list",
    ],
)
def test_malformed_values_are_400_not_500(stack, path, body):
    base, _, _ = stack
    response = httpx.post(base + path, json=body, headers=auth(VICTIM_KEY), timeout=60)
    assert response.status_code == 400, response.text


# ----------------------------------------------------------------------------- grammars


def lark_alternatives(n: int) -> str:
    return "start: item+\nitem: " + " | ".join(f'"w{i:05d}x"' for i in range(n)) + "\n"


def slow_grammar(tokenizer) -> str:
    """A grammar that takes this CPU at least 3 x GRAMMAR_TIMEOUT_S to compile, as the server
    compiles it (timed here, in this process): the test holds on a CPU of any speed."""
    grammars = Grammars(tokenizer, MAX_GRAMMAR_BYTES, timeout_s=60)
    grammars._tokenizer()  # built once, before the timing
    n = 6_000
    while True:
        grammar = lark_alternatives(n)
        started = time.monotonic()
        grammars._compile(GrammarSpec("lark", grammar))
        if time.monotonic() - started >= 3 * GRAMMAR_TIMEOUT_S:
            return grammar
        assert len(lark_alternatives(2 * n)) <= MAX_GRAMMAR_BYTES, "no grammar under the bound is slow enough"
        n *= 2


def test_grammar_size_compile_time_and_failures_are_bounded(stack, tiny_llama_dir):
    """Larger than server.max_grammar_bytes: 400 at once. One that compiles longer than
    server.grammar_compile_timeout_s: 400, and its second try is refused from the cache at once;
    meanwhile another request's grammar compiles and answers (compiles run side by side)."""
    base, _, server_pid = stack
    big = {"structured_outputs": {"grammar": "x" * (MAX_GRAMMAR_BYTES + 1)}}
    refused = completion(base, **big)
    assert refused.status_code == 400 and "server.max_grammar_bytes" in refused.text, refused.text

    slow = {"structured_outputs": {"grammar": slow_grammar(load_tokenizer(tiny_llama_dir))}}
    with ThreadPoolExecutor(2) as pool:
        idle = thread_cpu_seconds(server_pid)
        timed_out = pool.submit(completion, base, ATTACKER_KEY, **slow)
        wait_until(
            lambda: worker_thread_busy(server_pid, idle) or timed_out.done(),
            30,
            "the slow grammar compiling in the server's pool",
        )
        other = completion(base, structured_outputs={"choice": ["yes", "no"]})
        timed_out = timed_out.result()
    assert other.status_code == 200 and other.json()["choices"][0]["text"] in ("yes", "no"), other.text
    assert timed_out.status_code == 400 and "grammar_compile_timeout_s" in timed_out.text, timed_out.text
    started = time.monotonic()
    again = completion(base, ATTACKER_KEY, **slow)
    assert again.status_code == 400 and "grammar_compile_timeout_s" in again.text
    # A clock is the subject: a refusal from the cache comes at once, a compile again only after
    # the timeout (the same message either way).
    assert time.monotonic() - started < GRAMMAR_TIMEOUT_S


# ------------------------------------------------------------------------------- Triton


@pytest.mark.parametrize("path", ["generate", "infer"])
def test_triton_requests_stop_generating_when_the_client_goes(stack, path):
    """The request is aborted (on main it ran to its end, counted ok, with nobody to read it)."""
    base, port, _ = stack
    before = aborted_requests(base, auth(VICTIM_KEY))
    parameters = {"max_tokens": 480, "ignore_eos": True}
    body = (
        {"text_input": VICTIM_PROMPT, "parameters": parameters}
        if path == "generate"
        else {
            "inputs": [{"name": "text_input", "shape": [1], "datatype": "BYTES", "data": [VICTIM_PROMPT]}],
            "parameters": parameters,
        }
    )
    data = json.dumps(body).encode()
    sock = socket.create_connection(("127.0.0.1", port))
    sock.sendall(
        f"POST /v2/models/tiny/{path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
        f"Content-Type: application/json\r\nAuthorization: Bearer {VICTIM_KEY}\r\n"
        f"Content-Length: {len(data)}\r\n\r\n".encode()
        + data
    )
    wait_until(lambda: batch_size(base) == 1, 30, "the request running")
    sock.close()
    wait_until(lambda: batch_size(base) == 0, 30, "the request stopped")
    assert aborted_requests(base, auth(VICTIM_KEY)) == before + 1, "the answer went on without its client"


# ---------------------------------------------------------------------------------- fairness


def test_a_flooding_client_cannot_lock_another_out(stack, victim_alone):
    """The attacker's key holds every slot with long answers and fills the waiting queue; the
    victim's request (another key) is still admitted, takes the next slot that frees, before every
    queued request of the attacker, and answers exactly as alone; meanwhile more of the attacker's
    requests get 429 with Retry-After naming scheduler.client_share."""
    base, _, _ = stack
    seen: list = []  # (stream, "sent" | "admitted" | "first token"), in the order they happened

    def attacker(i: int):  # the slot holders end one after the other
        body = long_answer(300 + 20 * min(i, SLOTS))
        return stream_text(base, body, ATTACKER_KEY, seen, f"a{i}")

    def happened(*events) -> bool:
        return all(e in seen for e in events)

    with ThreadPoolExecutor(SLOTS + MAX_WAITING + 1) as pool:
        holders = [pool.submit(attacker, i) for i in range(SLOTS)]
        wait_until(lambda: batch_size(base) == SLOTS, 30, "every slot held by the attacker")
        queued = [pool.submit(attacker, SLOTS + i) for i in range(MAX_WAITING)]
        admitted = [(f"a{SLOTS + i}", "admitted") for i in range(MAX_WAITING)]
        wait_until(lambda: happened(*admitted), 30, "the attacker's queued requests admitted")
        seen.append(("victim", "sent"))
        victim = pool.submit(stream_text, base, long_answer(), VICTIM_KEY, seen, "victim")
        wait_until(lambda: happened(("victim", "admitted")) or victim.done(), 30, "the victim admitted")
        over = httpx.post(
            f"{base}/models/tiny/generate", json=long_answer(4), headers=auth(ATTACKER_KEY), timeout=60
        )
        text = victim.result(timeout=120)
        for future in holders + queued:
            future.result(timeout=120)
    assert over.status_code == 429 and "scheduler.client_share" in over.text, over.text
    assert over.headers.get("retry-after"), over.headers
    assert text == victim_alone
    # Every queued request of the attacker that started after the victim arrived started after it.
    arrived = seen.index(("victim", "sent"))
    later = [seen.index((f"a{SLOTS + i}", "first token")) for i in range(MAX_WAITING)]
    later = [at for at in later if at > arrived]
    assert later and seen.index(("victim", "first token")) < min(later), seen


def test_priority_is_refused_under_first_come_first_served(stack):
    base, _, _ = stack
    refused = completion(base, priority=-1)
    assert refused.status_code == 400 and "scheduling_policy" in refused.text, refused.text


def test_a_client_that_stops_reading_is_dropped_and_its_slot_freed(stack):
    """A streamed answer of 8 choices of 2000 tokens with 20 alternatives each (~20 MB) to a socket
    that reads nothing: once the buffers are full, server.stream_write_timeout_s later the server
    closes the connection (the answer cut off) and the request's slots are free again (on main the
    answer was held for the client for as long as it stayed connected)."""
    base, port, _ = stack
    data = json.dumps(
        {
            "model": "tiny",
            "messages": [{"role": "user", "content": VICTIM_PROMPT}],
            "n": 8,
            "max_tokens": 2000,
            "ignore_eos": True,
            "logprobs": True,
            "top_logprobs": 20,
            "stream": True,
        }
    ).encode()
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 2048)
    sock.connect(("127.0.0.1", port))
    sock.sendall(
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
        f"Authorization: Bearer {VICTIM_KEY}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(data)}\r\n\r\n".encode()
        + data
    )
    try:
        wait_until(lambda: batch_size(base) == 8, 30, "the 8 choices running")
        wait_until(lambda: batch_size(base) == 0, 60, "the stalled stream's slots freed")
        sock.settimeout(10)
        received = b""
        while chunk := sock.recv(1 << 16):  # what was buffered, then the server's close
            received += chunk
        assert received.startswith(b"HTTP/1.1 200")
        # Cut off: on main the answer was held for the client, then sent whole once it read.
        assert b"[DONE]" not in received and received.count(b"data:") < 8 * 2000
    finally:
        sock.close()
