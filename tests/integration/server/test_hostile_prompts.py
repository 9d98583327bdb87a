"""Hostile prompts against a real agent and `start_server.py` on the tiny model (hardening round 4),
each beside a victim whose exact answer (greedy, computed alone first) must come out unchanged while
`/health` answers within 1 s:

- conversations of empty messages: the size estimate counted only each message's content, so a
  1 MB body of 50,000 `{"role": "user"}` was rendered by the template and tokenized on the event
  loop before it was refused; now a conversation holds at most 4,096 messages (the schemas stop
  validating past them), each message counts its fields and the template's own text, one of more
  messages than the longest prompt has tokens is refused unrendered, and every conversation renders
  off the event loop;
- prompt logprobs outside the reply bound: `n` x `echo` x `prompt_logprobs` over a long prompt with
  `max_tokens: 0` asked for millions of entries, streamed or whole;
- a chat template (the model's file's) that loops for ever, builds a 10 GB string or writes without
  end: bounded by its render budget, a 500 naming the template (413 for a prompt past the longest),
  and the server goes on;
- a `cache_salt` holding a lone surrogate: refused where it enters, on every API, saying why.
"""

import json
import shutil
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from agent_harness import LONG_ANSWERS_RUNTIME, free_ports, serving_stack, write_config
from attack_watch import under_attack
from tiny_models import CHATML

RUNTIME = {**LONG_ANSWERS_RUNTIME, "max_seq_len": 2048, "attend_buckets": [64, 512, 2048]}
MAX_REPLY_LOGPROBS = 20000
JSON = {"content-type": "application/json"}
NOT_TEXT = "\udfff"  # a lone surrogate
HI = [{"role": "user", "content": "hi"}]
FLOOD_MESSAGES = 30000  # under 1 MB (server.max_body_bytes) in each API's shape
# The tiny model's template with three hostile branches, chosen by the last message's text.
HOSTILE_TEMPLATE = (
    "{% if messages[-1].content == 'loop forever' %}{% for i in range(100000) %}{% for j in range(100000) %}"
    "{% endfor %}{% endfor %}{% endif %}"
    "{% if messages[-1].content == 'build huge' %}{{ 'x' * 10**10 }}{% endif %}"
    "{% if messages[-1].content == 'write forever' %}{% for i in range(100000) %}{% for j in range(100000) %}"
    "xxxxxxxx{% endfor %}{% endfor %}{% endif %}" + CHATML
)


@pytest.fixture(scope="module")
def base(tmp_path_factory, tiny_llama_dir):
    directory = tmp_path_factory.mktemp("hostile-prompts")
    model = shutil.copytree(tiny_llama_dir, directory / "model")
    config = json.loads((model / "tokenizer_config.json").read_text())
    (model / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": HOSTILE_TEMPLATE}))
    agent_port, http_port = free_ports(2)
    path = write_config(
        directory,
        model,
        [agent_port],
        runtime=RUNTIME,
        server={"port": http_port, "max_reply_logprobs": MAX_REPLY_LOGPROBS},
    )
    with serving_stack(path):
        yield f"http://127.0.0.1:{http_port}"


def victim(base: str) -> str:
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "The capital of France is"}],
        "max_tokens": 300,
        "ignore_eos": True,
        "temperature": 0,
    }
    reply = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=300)
    assert reply.status_code == 200, reply.text
    return reply.json()["choices"][0]["message"]["content"]


@pytest.fixture(scope="module")
def expected(base) -> str:
    return victim(base)


def post(base: str, path: str, body: dict, **kw) -> httpx.Response:
    return httpx.post(f"{base}{path}", json={"model": "tiny", **body}, timeout=300, **kw)


def error_message(reply: httpx.Response) -> str:
    body = reply.json()
    error = body.get("error", body)
    return error["message"] if isinstance(error, dict) else str(error)


def flood(path: str, count: int) -> dict:
    """A body of `count` empty messages (the APIs that need a content get an empty one)."""
    if path == "/tokenize":
        return {"messages": [{"role": "user"}] * count}
    if path == "/v1/chat/completions":
        return {"messages": [{"role": "user"}] * count, "max_tokens": 1}
    empty = [{"role": "user", "content": ""}] * count
    return (
        {"input": empty, "max_output_tokens": 16}
        if path == "/v1/responses"
        else {"messages": empty, "max_tokens": 1}
    )


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/tokenize", "/v1/messages", "/v1/responses"])
@pytest.mark.parametrize(
    "count, status, says",
    [
        (FLOOD_MESSAGES, (400, 422), "at most 4096 items"),  # past the schemas' bound: not even converted
        (3000, (413,), "the conversation has 3000 messages"),  # past the longest prompt's tokens: unrendered
    ],
    ids=["flood", "past-the-context"],
)
def test_conversations_of_empty_messages_are_refused_unrendered(base, expected, path, count, status, says):
    body = flood(path, count)
    with under_attack(base, lambda: victim(base), expected, f"empty messages {path}"):
        with ThreadPoolExecutor(4) as pool:
            replies = list(pool.map(lambda _: post(base, path, body), range(4)))
    for reply in replies:
        assert reply.status_code in status, reply.text[:300]
        assert says in error_message(reply), error_message(reply)


def test_empty_messages_count_the_templates_own_text(base):
    """200 empty messages (fewer than the longest prompt's tokens) hold no content but render
    ChatML's markers each: counted, the estimate refuses them before the render."""
    reply = post(base, "/v1/chat/completions", {"messages": [{"role": "user", "content": ""}] * 1500})
    assert reply.status_code == 413, reply.text
    assert "characters" in error_message(reply)


def test_prompt_logprobs_count_in_the_reply_bound(base, expected):
    prompt = [5] * 300  # 8 choices x 300 prompt tokens x 21 logprobs: 50,400 entries, twice (echo)
    bomb = {"prompt": prompt, "n": 8, "echo": True, "logprobs": 20, "prompt_logprobs": 20, "max_tokens": 0}
    with under_attack(base, lambda: victim(base), expected, "prompt logprobs"):
        for stream in (False, True):
            reply = post(base, "/v1/completions", {**bomb, "stream": stream})
            assert reply.status_code == 400, reply.text[:300]
            assert "prompt_logprobs" in reply.text and "server.max_reply_logprobs" in reply.text
    small = {"prompt": prompt, "prompt_logprobs": 5, "max_tokens": 1, "stream": True}
    with httpx.stream(
        "POST", f"{base}/v1/completions", json={"model": "tiny", **small}, timeout=300
    ) as reply:
        assert reply.status_code == 200
        chunks = [json.loads(line[5:]) for line in reply.iter_lines() if line.startswith("data: {")]
    assert len(chunks[0]["choices"][0]["prompt_logprobs"]) == len(prompt)


@pytest.mark.parametrize(
    "content, status, says",
    [
        ("loop forever", 500, "ran past 2 s"),
        ("build huge", 500, "past the budget"),
        ("write forever", 413, "renders this conversation too long"),
    ],
)
def test_a_chat_template_past_its_budget_fails_its_request_alone(base, expected, content, status, says):
    body = {"messages": [{"role": "user", "content": content}], "max_tokens": 1}
    started = time.perf_counter()
    with under_attack(base, lambda: victim(base), expected, f"chat template: {content}"):
        reply = post(base, "/v1/chat/completions", body)
    assert reply.status_code == status, reply.text
    message = error_message(reply)
    assert says in message and "chat template" in message, message
    assert time.perf_counter() - started < 60
    assert post(
        base, "/v1/chat/completions", {**body, "messages": [{"role": "user", "content": "hi"}]}
    ).is_success


@pytest.mark.parametrize(
    "path, body",
    [
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 2}),
        ("/v1/messages", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}),
        ("/v1/responses", {"input": "hi", "max_output_tokens": 16}),
        (
            "/models/tiny/generate",
            {"inputs": "hi", "parameters": {"max_new_tokens": 2, "cache_salt": "\udfff"}},
        ),
    ],
    ids=["chat", "completions", "messages", "responses", "native"],
)
def test_a_lone_surrogate_cache_salt_is_refused_where_it_enters(base, expected, path, body):
    """The body's JSON parser refuses the lone escape itself, saying where; a salt that reached a
    schema would be refused there (pydantic's str: test_tenant_salt), and one that reached the block
    manager still hashes (test_block_manager)."""
    raw = json.dumps({"model": "tiny", "cache_salt": "tenant-\ud800", **body})  # as the JSON escape
    with under_attack(base, lambda: victim(base), expected, f"lone surrogate {path}"):
        reply = httpx.post(f"{base}{path}", content=raw, headers=JSON, timeout=60)
    assert reply.status_code == 400, reply.text
    assert "not valid JSON" in reply.text and "hex escape" in reply.text, reply.text


@pytest.mark.parametrize(
    "path, body",
    [
        ("/v1/completions", {"prompt": "hi", "max_tokens": 2, "mirostat": 2, "mirostat_tau": 5.0}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "dry_multiplier": 0.8}),
        (
            "/v1/messages",
            {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "xtc_probability": 0.5},
        ),
        ("/v1/responses", {"input": "hi", "max_output_tokens": 16, "tfs_z": 0.9}),
    ],
    ids=["completions", "chat", "messages", "responses"],
)
def test_sampling_parameters_this_server_lacks_are_refused_not_ignored(base, expected, path, body):
    """A client tuned for llama.cpp or vLLM gets an error naming what is not served, not other answers."""
    named = next(k for k in ("mirostat", "dry_multiplier", "xtc_probability", "tfs_z") if k in body)
    with under_attack(base, lambda: victim(base), expected, f"unserved sampling {named}"):
        with ThreadPoolExecutor(4) as pool:
            replies = list(pool.map(lambda _: post(base, path, body), range(4)))
    for reply in replies:
        assert reply.status_code == 400, reply.text
        assert named in error_message(reply), error_message(reply)
