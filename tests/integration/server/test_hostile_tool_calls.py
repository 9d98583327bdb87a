"""Hostile tool calls against a real agent and `start_server.py` on the tiny model, each beside a
victim whose exact answer (greedy, computed alone first) must come out unchanged while `/health`
answers within 1 s:

- an answer that opens `<tool_call>` and never closes it (the tag reader backtracked in cubic time
  on it, on the event loop: seconds for one answer of 2,000 spaces);
- JSON nested past the bound: a history call's arguments (chat and Responses), a schema given as
  text, and a model answer of 1,200 brackets with tools offered (json.loads raised RecursionError,
  which nothing caught: a 500).
"""

from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from agent_harness import LONG_ANSWERS_RUNTIME, free_ports, serving_stack, write_config
from attack_watch import under_attack

RUNTIME = {**LONG_ANSWERS_RUNTIME, "max_seq_len": 2048, "attend_buckets": [64, 512, 2048]}
# Four unclosed answers of 1,700 spaces each cost the pattern at least 5 s on the event loop.
ATTACK_TOKENS, ATTACK_CHOICES = 1700, 4
BRACKETS = 1200
DEEP = "[" * 3000 + "]" * 3000
ADD = {"name": "add", "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}}}


@pytest.fixture(scope="module")
def base(tmp_path_factory, tiny_llama_dir):
    agent_port, http_port = free_ports(2)
    path = write_config(
        tmp_path_factory.mktemp("hostile-tools"),
        tiny_llama_dir,
        [agent_port],
        runtime=RUNTIME,
        server={"port": http_port},
    )
    with serving_stack(path):
        yield f"http://127.0.0.1:{http_port}"


def victim(base: str) -> str:
    body = {
        "inputs": "The capital of France is",
        "parameters": {"max_new_tokens": 300, "ignore_eos": True},
    }
    reply = httpx.post(f"{base}/models/tiny/generate", json=body, timeout=300)
    assert reply.status_code == 200, reply.text
    return reply.json()["generated_text"]


@pytest.fixture(scope="module")
def expected(base) -> str:
    return victim(base)


def post(base: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{base}{path}", json={"model": "tiny", "temperature": 0, **body}, timeout=300)


def chat(base: str, messages: list[dict], **body) -> httpx.Response:
    tools = [{"type": "function", "function": ADD}]
    return post(base, "/v1/chat/completions", {"messages": messages, "tools": tools, **body})


def test_an_unclosed_tool_call_tag_does_not_freeze_the_server(base, expected):
    """On main /health waited seconds while the answers' tags were read (the victim with it)."""
    with under_attack(base, lambda: victim(base), expected, "unclosed <tool_call>"):
        reply = chat(
            base,
            [{"role": "user", "content": "Add 1."}],
            n=ATTACK_CHOICES,
            structured_outputs={"regex": "<tool_call> +"},
            min_tokens=ATTACK_TOKENS,
            max_tokens=ATTACK_TOKENS,
        )
    assert reply.status_code == 200, reply.text
    choices = reply.json()["choices"]
    assert len(choices) == ATTACK_CHOICES
    for choice in choices:  # no call: the text is the answer
        assert choice["message"]["content"].rstrip(" ") == "<tool_call>"
        assert not choice["message"].get("tool_calls")
        assert choice["finish_reason"] == "length"
    assert reply.json()["usage"]["completion_tokens"] == ATTACK_CHOICES * ATTACK_TOKENS


def call_history(arguments: str) -> list[dict]:
    call = {"id": "c1", "type": "function", "function": {"name": "add", "arguments": arguments}}
    return [
        {"role": "user", "content": "Add 1."},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "2"},
    ]


def responses_history(arguments: str) -> dict:
    return {
        "input": [
            {"type": "message", "role": "user", "content": "Add 1."},
            {"type": "function_call", "call_id": "c1", "name": "add", "arguments": arguments},
            {"type": "function_call_output", "call_id": "c1", "output": "2"},
        ],
        "tools": [{"type": "function", **ADD}],
        "max_output_tokens": 4,
    }


def refusals(base: str) -> list[tuple[httpx.Response, str]]:
    """Requests nested too deep, each with what its 400 must say."""
    user = [{"role": "user", "content": "Add 1."}]
    too_deep = "deeper than 200 levels"
    return [
        (chat(base, call_history(DEEP), max_tokens=4), too_deep),
        (post(base, "/v1/responses", responses_history(DEEP)), too_deep),
        (chat(base, user, max_tokens=4, structured_outputs={"json": DEEP}), too_deep),
        # Whether a grammar was asked for beside the call's was found by building it, unguarded.
        (
            chat(base, user, max_tokens=4, tool_choice="required", structured_outputs={"json": DEEP}),
            "both constrain the answer",
        ),
    ]


def test_json_nested_too_deep_is_a_400_or_text_never_a_500(base, expected):
    """On main json.loads raised RecursionError, which only ValueError's handler would have
    caught: each of these was a 500."""
    brackets = {"structured_outputs": {"regex": r"\[+"}, "min_tokens": BRACKETS, "max_tokens": BRACKETS}
    user = [{"role": "user", "content": "Add 1."}]
    with under_attack(base, lambda: victim(base), expected, "JSON nested too deep"):
        with ThreadPoolExecutor(1) as pool:
            answer = pool.submit(chat, base, user, **brackets)
            refused = refusals(base)
            answered = answer.result()
    statuses = [reply.status_code for reply, _ in refused] + [answered.status_code]
    assert statuses == [400] * len(refused) + [200], [reply.text for reply, _ in refused]
    for reply, problem in refused:
        assert problem in reply.json()["error"]["message"], reply.text
    message = answered.json()["choices"][0]["message"]
    assert set(message["content"]) == {"["} and len(message["content"]) >= BRACKETS
    assert not message.get("tool_calls")
