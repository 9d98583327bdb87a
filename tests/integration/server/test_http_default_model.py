"""The HTTP front end on the embedded default model (SmolLM2-135M-Instruct): real answers through
all three response styles, UTF-8-safe streaming, and SIGTERM cutting long streams at the drain
timeout."""

import enum
import json
import re
import signal
import threading
import time

import httpx
import numpy as np
import openai
import pytest
from httpx_sse import connect_sse
from pydantic import BaseModel, Field

import reference_numpy as ref
from agent_harness import free_ports, serving_stack, write_config
from http_client import answer_three_ways, data_lines, post

pytestmark = pytest.mark.default_model
DRAIN_TIMEOUT_S = 3
CJK = re.compile(r"[\u4e00-\u9fff]")
EMOJI = re.compile(r"[\U0001F300-\U0001FAFF\u2600-\u27BF]")


@pytest.fixture(scope="module")
def stack(tmp_path_factory, default_model_path):
    agent_port, http_port = free_ports(2)
    path = write_config(
        tmp_path_factory.mktemp("http-default"),
        default_model_path,
        [agent_port],
        model={"name": "smollm2"},
        runtime={
            "num_slots": 4,
            "max_seq_len": 1024,  # room for streams that outlast the drain (the last test)
            "prefill_buckets": [64],
            "decode_batch_buckets": [1, 4],
            "attend_buckets": [1024],
            "compile_cache_dir": None,
            "activations": "float32",  # exact: answers and logprobs are checked against the float reference
        },
        server={"port": http_port, "drain_timeout_s": DRAIN_TIMEOUT_S},
    )
    with serving_stack(path, agents_timeout=300) as (_agents, server):
        yield f"http://127.0.0.1:{http_port}", server


def test_capital_of_france_is_paris_in_all_three_styles(stack):
    base, _ = stack
    full, sse, plain = answer_three_ways(
        base, "smollm2", "What is the capital of France?", {"max_new_tokens": 20, "chat_template": True}
    )
    assert "Paris" in full and full == sse == plain


@pytest.mark.parametrize(
    "prompt, expect",
    [
        ("How do you say 'hello' in Chinese?", CJK),
        ("Reply with three emoji that describe happiness.", EMOJI),
        ("Write a haiku about the sea.", re.compile("\n")),
    ],
)
def test_streamed_pieces_join_to_the_full_text(stack, prompt, expect):
    base, _ = stack
    full, sse, plain = answer_three_ways(
        base, "smollm2", prompt, {"max_new_tokens": 40, "chat_template": True}
    )
    assert expect.search(full), full
    assert "\ufffd" not in full and full == sse == plain


def test_logprobs_match_the_independent_reference(stack, default_model_path):
    """TGI details on the default model: greedy ids, their logprobs and the top 5 against a numpy
    log-softmax of the reference's logits; the plain protocol's token fields agree with them."""
    base, _ = stack
    question = "What is the capital of France?"
    parameters = {"max_new_tokens": 8, "chat_template": True, "details": True, "top_n_tokens": 5}
    reply = post(f"{base}/models/smollm2/generate", {"inputs": question, "parameters": parameters}).json()
    details = reply["details"]
    ids = [t["id"] for t in details["tokens"]]
    messages = [{"role": "user", "content": question}]
    prompt = post(f"{base}/tokenize", {"model": "smollm2", "messages": messages}).json()["tokens"]
    reference = ref.load_gguf_reference(default_model_path)
    logits = ref.forward(reference, prompt + ids[:-1], ref.RefCache())[len(prompt) - 1 :]
    shifted = logits - logits.max(-1, keepdims=True)
    want = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
    assert ids == [int(i) for i in np.argmax(logits, -1)]
    for row, token, top in zip(want, details["tokens"], details["top_tokens"]):
        assert abs(token["logprob"] - row[token["id"]]) < 1e-3 and not token["special"]
        assert top[0]["id"] == token["id"] and len(top) == 5
        assert [t["logprob"] for t in top] == pytest.approx(np.sort(row)[::-1][:5], abs=1e-3)
    assert "".join(t["text"] for t in details["tokens"]) == reply["generated_text"]
    assert details["finish_reason"] in ("length", "eos_token") and details["generated_tokens"] >= len(ids)

    lines = data_lines(
        f"{base}/models/smollm2/generate_stream",
        {"inputs": question, "parameters": {**parameters, "return_protocol": "plain"}},
    )
    tokens = [line["token"] for line in lines]
    assert [t["id"] for t in tokens] == ids  # one ASCII token a piece
    assert [t["logprob"] for t in tokens] == pytest.approx(
        [t["logprob"] for t in details["tokens"]], abs=1e-5
    )
    assert all(line["top_tokens"][0]["id"] == line["token"]["id"] for line in lines)


class Address(BaseModel):
    city: str = Field(max_length=40)
    zip_code: str = Field(pattern=r"^[0-9]{5}$")


class Colour(str, enum.Enum):
    red = "red"
    green = "green"
    blue = "blue"


class Person(BaseModel):
    name: str = Field(max_length=40)
    age: int = Field(ge=0, le=120)
    favourite_colour: Colour
    address: Address
    hobbies: list[str] = Field(max_length=3)


class Grade(BaseModel):
    subject: str = Field(max_length=40)
    score: float = Field(ge=0, le=100)
    passed: bool


class Report(BaseModel):
    student: str = Field(max_length=40)
    grades: list[Grade] = Field(min_length=1, max_length=3)


@pytest.mark.parametrize(
    "schema, question",
    [
        (Person, "Describe a fictional person."),
        (Grade, "Grade a maths exam."),
        (Report, "Write a school report with two grades."),
    ],
)
def test_parse_returns_objects_of_the_schema_streamed_or_not(stack, schema, question):
    """The `openai` package's parse() and stream() with a pydantic model (a strict json_schema
    response_format): nested objects, arrays, enums, required fields, bounded numbers."""
    sdk = openai.OpenAI(base_url=f"{stack[0]}/v1", api_key="unused", max_retries=0)
    kwargs = dict(
        model="smollm2",
        messages=[{"role": "user", "content": question}],
        response_format=schema,
        max_tokens=200,
        temperature=0,
    )
    reply = sdk.chat.completions.parse(**kwargs)
    parsed = reply.choices[0].message.parsed
    assert isinstance(parsed, schema) and reply.choices[0].finish_reason == "stop"
    with sdk.chat.completions.stream(**kwargs) as stream:
        assert stream.get_final_completion().choices[0].message.parsed == parsed


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 20}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}


def test_a_tool_call_round_trip(stack):
    """The default model's template has no tools: they go in a system message. A required call,
    its result as a tool message, then the answer that uses it."""
    sdk = openai.OpenAI(base_url=f"{stack[0]}/v1", api_key="unused", max_retries=0)
    messages: list = [{"role": "user", "content": "What is the weather in Paris?"}]
    first = sdk.chat.completions.create(
        model="smollm2",
        messages=messages,
        tools=[WEATHER],
        tool_choice="required",
        temperature=0,
        max_tokens=80,
    )
    [call] = first.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}
    messages += [
        first.choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "18 degrees celsius and sunny"},
    ]
    final = sdk.chat.completions.create(
        model="smollm2", messages=messages, tools=[WEATHER], temperature=0, max_tokens=40
    )
    answer = final.choices[0].message
    assert answer.tool_calls is None and "sunny" in answer.content, answer


def test_sigterm_ends_unfinished_streams_with_a_final_event(stack):
    """Last in this module: 4 long streams outlast the 3 s drain; each ends with an error event,
    a request during the drain gets 503, and the process exits 0. The streams ignore EOS and ask
    for 900 tokens: some 9 s at 4 rows even on a fast machine (200 tokens ended within the drain
    once decode got faster)."""
    base, server = stack
    finals: list[dict] = []
    started = threading.Barrier(5)

    def stream(seed: int):
        body = {
            "inputs": "Tell me a long story about a dragon.",
            "parameters": {
                "max_new_tokens": 900,
                "ignore_eos": True,
                "do_sample": True,
                "temperature": 1.2,
                "seed": seed,
                "chat_template": True,
            },
        }
        with (
            httpx.Client(timeout=60) as client,
            connect_sse(client, "POST", f"{base}/models/smollm2/generate_stream", json=body) as source,
        ):
            events = source.iter_sse()
            next(events)
            started.wait()
            finals.append(json.loads(list(events)[-1].data))

    threads = [threading.Thread(target=stream, args=(seed,)) for seed in range(4)]
    for t in threads:
        t.start()
    started.wait(120)
    signalled = time.monotonic()
    server.process.send_signal(signal.SIGTERM)
    server.wait_for("refusing new requests, draining", 10)
    refused = post(f"{base}/models/smollm2/generate", {"inputs": "Hi"})
    assert refused.status_code == 503 and "shutting down" in refused.json()["error"]
    for t in threads:
        t.join(60)
    assert finals == [{"event": "error", "retry": 30000, "data": "the server is shutting down"}] * 4
    assert server.process.wait(DRAIN_TIMEOUT_S + 15) == 0
    assert time.monotonic() - signalled < DRAIN_TIMEOUT_S + 15
    assert "drain timeout: ending 4 unfinished request(s)" in server.output()
