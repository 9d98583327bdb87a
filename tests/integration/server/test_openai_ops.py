"""OpenAI-compatible API (driven by the official `openai` package), ops endpoints, access control and
the Python client, against a real agent + `start_server.py` on the tiny model with an API key on."""

import asyncio
import re
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Literal

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from agent.model.tokenizer import load_tokenizer
from agent_harness import LONG_ANSWERS_RUNTIME, free_ports, serving_stack, wait_gone, write_config
from browser import chromium_driver
from client import AsyncClient, Client, ServerError
from config.schema import PROJECT_ROOT

KEY = "test-key-123"
AUTH = {"Authorization": f"Bearer {KEY}"}
MAX_BODY = 4096


@pytest.fixture(scope="module")
def stack(tmp_path_factory, tiny_llama_dir):
    agent_port, http_port = free_ports(2)
    path = write_config(
        tmp_path_factory.mktemp("openai"),
        tiny_llama_dir,
        [agent_port],
        # Room for prompts that carry tool definitions (the tiny vocabulary spends a token a byte).
        runtime={**LONG_ANSWERS_RUNTIME, "max_seq_len": 1536, "attend_buckets": [64, 512, 1536]},
        agents={"restart_policy": "exit"},
        server={"port": http_port, "api_keys": [KEY], "max_body_bytes": MAX_BODY},
    )
    with serving_stack(path) as (agents, server):
        yield f"http://127.0.0.1:{http_port}", agents, server


@pytest.fixture(scope="module")
def sdk(stack):
    return openai.OpenAI(base_url=f"{stack[0]}/v1", api_key=KEY, max_retries=0)


@pytest.fixture(scope="module")
def tokenizer(tiny_llama_dir):
    return load_tokenizer(tiny_llama_dir)


MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hello there"}]


# ------------------------------------------------------------------------------------ access


def test_api_key_is_required_everywhere_but_health(stack):
    base = stack[0]
    assert httpx.get(f"{base}/health").status_code == 200
    for path in ("/ready", "/metrics", "/info", "/v1/models", "/serving/get_bs"):
        response = httpx.get(base + path)
        assert response.status_code == 401 and response.headers["www-authenticate"] == "Bearer", path
    assert httpx.get(f"{base}/v1/models", headers={"Authorization": "Bearer wrong"}).status_code == 401
    native = httpx.post(f"{base}/models/tiny/generate", json={"inputs": "x"})
    assert native.status_code == 401 and "API key" in native.json()["error"]
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{base}/v1", api_key="wrong", max_retries=0).models.list()
    assert httpx.get(f"{base}/v1/models", headers=AUTH).status_code == 200


def test_log_lines_never_contain_api_keys(stack, tmp_path):
    """The access log would show the dashboard's ?api_key=; a wrong key must not be logged either."""
    base, _, server = stack
    wrong = "wrong-key-456"
    assert httpx.get(f"{base}/dashboard", params={"api_key": KEY}).status_code == 200
    assert httpx.get(f"{base}/dashboard", params={"api_key": wrong}).status_code == 401
    assert httpx.get(f"{base}/info", headers={"Authorization": f"Bearer {wrong}"}).status_code == 401
    assert httpx.get(f"{base}/info", headers=AUTH).status_code == 200
    server.wait_for("GET /info", 10)
    logs = server.output() + "".join(
        p.read_text() for p in (server.config_path.parent / "logs").glob("server_app.log*")
    )
    assert "/dashboard?api_key=***" in logs
    assert KEY not in logs and wrong not in logs


def test_request_body_limit(stack):
    base = stack[0]
    big = {"inputs": "x" * (MAX_BODY + 10)}
    response = httpx.post(f"{base}/models/tiny/generate", json=big, headers=AUTH)
    assert response.status_code == 413 and f"larger than {MAX_BODY}" in response.json()["error"]
    chunked = httpx.post(
        f"{base}/v1/completions", content=iter([b'{"prompt": "', b"x" * MAX_BODY, b'"}']), headers=AUTH
    )
    assert chunked.status_code == 413 and chunked.json()["error"]["type"] == "invalid_request_error"


# ------------------------------------------------------------------------------------ OpenAI


def test_models_lists_the_served_name(sdk):
    assert [m.id for m in sdk.models.list().data] == ["tiny"]


def test_chat_completion_stream_and_not_agree_with_usage(sdk, tokenizer):
    reply = sdk.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=12, temperature=0)
    choice = reply.choices[0]
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason in ("stop", "length")
    prompt_tokens = len(tokenizer.encode_chat(MESSAGES))
    assert reply.usage.prompt_tokens == prompt_tokens
    if choice.finish_reason == "length":
        assert reply.usage.completion_tokens == 12
    assert reply.usage.total_tokens == prompt_tokens + reply.usage.completion_tokens

    chunks = list(
        sdk.chat.completions.create(
            model="tiny",
            messages=MESSAGES,
            max_tokens=12,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == choice.message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == choice.finish_reason
    assert chunks[-1].usage.completion_tokens == reply.usage.completion_tokens


def test_completion_stop_strings(sdk):
    full = sdk.completions.create(model="tiny", prompt="The quick brown fox", max_tokens=20, temperature=0)
    text = full.choices[0].text
    stop = text[6:9]
    assert len(text) > 9 and stop.strip()
    cut = sdk.completions.create(
        model="tiny", prompt="The quick brown fox", max_tokens=20, temperature=0, stop=[stop, "never-there"]
    )
    assert cut.choices[0].text == text[: text.index(stop)] and cut.choices[0].finish_reason == "stop"
    streamed = "".join(
        c.choices[0].text
        for c in sdk.completions.create(
            model="tiny", prompt="The quick brown fox", max_tokens=20, temperature=0, stop=stop, stream=True
        )
    )
    assert streamed == cut.choices[0].text


def test_seed_reproducibility_and_n(sdk):
    def sample(seed, n=1):
        reply = sdk.completions.create(
            model="tiny", prompt="Once upon a time", max_tokens=16, temperature=1.0, seed=seed, n=n
        )
        return [c.text for c in sorted(reply.choices, key=lambda c: c.index)]

    first = sample(7)
    assert sample(7) == first and sample(8) != first
    assert sample(7, n=2) == [first[0], sample(8)[0]]  # choice i uses seed + i


def test_penalties_are_honoured_and_unsupported_parameters_refused(sdk):
    reply = sdk.completions.create(
        model="tiny",
        prompt="a b a b",
        max_tokens=8,
        temperature=0,
        presence_penalty=1.5,
        frequency_penalty=0.5,
    )
    assert reply.choices[0].text
    for kwargs, word in [
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"top_logprobs": 2}, "top_logprobs"),  # without logprobs: true
        ({"presence_penalty": -1.0}, "negative"),
        ({"logit_bias": {"5": 101}}, "logit_bias"),
        ({"logit_bias": {"five": 1}}, "logit_bias"),
        ({"logit_bias": {"100000": 1}}, "logit_bias"),  # past the vocabulary
        ({"extra_body": {"stop_token_ids": [100000]}}, "stop_token_ids"),
        ({"extra_body": {"min_tokens": -1}}, "min_tokens"),
    ]:
        with pytest.raises(openai.BadRequestError, match=word):
            sdk.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=4, **kwargs)
    for kwargs, word in [
        ({"temperature": 3.0}, "temperature"),
        ({"logprobs": 21}, "logprobs"),
        ({"suffix": "and so on"}, "suffix"),
    ]:
        with pytest.raises(openai.BadRequestError, match=word):
            sdk.completions.create(model="tiny", prompt="x", **kwargs)
    with pytest.raises(openai.NotFoundError, match="served: tiny"):
        sdk.completions.create(model="gpt-5", prompt="x")


def greedy_ids(base: str, prompt: str, n: int, **parameters) -> tuple[list[int], dict]:
    """The native API's greedy answer as token ids (TGI details), and the details."""
    body = {"inputs": prompt, "parameters": {"max_new_tokens": n, "details": True, **parameters}}
    reply = httpx.post(f"{base}/models/tiny/generate", headers=AUTH, json=body, timeout=60)
    assert reply.status_code == 200, reply.text
    details = reply.json()["details"]
    return [t["id"] for t in details["tokens"]], details


def test_logit_bias_stop_token_ids_and_min_tokens_steer_the_answer(stack, sdk, tokenizer):
    base = stack[0]
    [lifted] = tokenizer.encode("cat", add_special_tokens=False)[:1]
    reply = sdk.completions.create(
        model="tiny", prompt="Once upon", max_tokens=4, temperature=0, logit_bias={str(lifted): 100}
    )
    assert reply.choices[0].text == tokenizer.decode([lifted] * 4)
    answer, _ = greedy_ids(base, "Once upon", 6, ignore_eos=True)
    stopped = sdk.completions.create(
        model="tiny",
        prompt="Once upon",
        max_tokens=6,
        temperature=0,
        extra_body={"stop_token_ids": [answer[2]]},
    )
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.choices[0].text == tokenizer.decode(answer[:2])  # the stop id ends it, unshown
    held = sdk.completions.create(
        model="tiny",
        prompt="Once upon",
        max_tokens=6,
        temperature=0,
        extra_body={"stop_token_ids": [answer[0]], "min_tokens": 3, "ignore_eos": True},
    )
    assert held.usage.completion_tokens >= 3 and answer[0] not in tokenizer.encode(held.choices[0].text)[:1]


def test_chat_and_completion_logprobs_streamed_and_not(sdk):
    def chat(stream: bool):
        kwargs = dict(
            model="tiny", messages=MESSAGES, max_tokens=6, temperature=0, logprobs=True, top_logprobs=3
        )
        if not stream:
            reply = sdk.chat.completions.create(**kwargs)
            return reply.choices[0].message.content, reply.choices[0].logprobs.content
        chunks = list(sdk.chat.completions.create(**kwargs, stream=True))
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        return text, [
            i for c in chunks if c.choices and c.choices[0].logprobs for i in c.choices[0].logprobs.content
        ]

    text, items = chat(False)
    # A token may hold part of a character: its bytes are exact, its text shows U+FFFD.
    assert items and b"".join(bytes(i.bytes) for i in items).decode(errors="replace") == text
    for item in items:  # greedy: the chosen token is the most likely one
        values = [t.logprob for t in item.top_logprobs]
        assert len(values) == 3 and values == sorted(values, reverse=True) and all(v <= 0 for v in values)
        assert item.top_logprobs[0].token == item.token and item.top_logprobs[0].logprob == item.logprob
        assert bytes(item.bytes).decode(errors="replace") == item.token
    streamed_text, streamed = chat(True)
    assert streamed_text == text
    assert [(i.token, i.logprob) for i in streamed] == [
        (i.token, pytest.approx(i.logprob, abs=1e-5)) for i in items
    ]

    reply = sdk.completions.create(model="tiny", prompt="Once upon", max_tokens=5, temperature=0, logprobs=2)
    shown = reply.choices[0].logprobs
    assert len(shown.token_logprobs) == len(shown.tokens) == reply.usage.completion_tokens
    assert all(
        len(top) <= 2 and max(top.values()) == lp for top, lp in zip(shown.top_logprobs, shown.token_logprobs)
    )
    assert shown.text_offset == [sum(map(len, shown.tokens[:i])) for i in range(len(shown.tokens))]
    chunks = list(
        sdk.completions.create(
            model="tiny", prompt="Once upon", max_tokens=5, temperature=0, logprobs=2, stream=True
        )
    )
    assert [t for c in chunks if c.choices[0].logprobs for t in c.choices[0].logprobs.tokens] == shown.tokens
    plain = sdk.completions.create(model="tiny", prompt="Once upon", max_tokens=5, temperature=0)
    assert plain.choices[0].logprobs is None and plain.choices[0].text == reply.choices[0].text


class Pet(BaseModel):
    name: str = Field(max_length=8)
    kind: Literal["cat", "dog", "fish"]
    age: int = Field(ge=0, le=30)
    weight: float = Field(ge=0.5, le=80)


class Household(BaseModel):
    owner: str = Field(max_length=8)
    pets: list[Pet] = Field(max_length=2)
    indoor: bool


def test_structured_output_holds_even_on_a_random_model(sdk, stack):
    """The tiny model's weights are random: whatever it would say, the answer follows the grammar."""
    base = stack[0]
    schema = Household.model_json_schema()
    reply = sdk.chat.completions.create(
        model="tiny",
        messages=MESSAGES,
        max_tokens=400,
        temperature=1.0,
        seed=3,
        response_format={"type": "json_schema", "json_schema": {"name": "household", "schema": schema}},
    )
    assert reply.choices[0].finish_reason == "stop"
    Household.model_validate_json(reply.choices[0].message.content)
    for outputs, check in [
        ({"regex": "[a-z]{3}-[0-9]{2}"}, lambda text: re.fullmatch("[a-z]{3}-[0-9]{2}", text)),
        ({"choice": ["yes", "no", "maybe"]}, lambda text: text in ("yes", "no", "maybe")),
        (
            {"grammar": 'start: "(" NUMBER ("," NUMBER)* ")"\nNUMBER: /[0-9]{1,3}/'},
            lambda text: re.fullmatch(r"\(\d{1,3}(,\d{1,3})*\)", text),
        ),
    ]:
        for seed in (1, 2):
            text = (
                sdk.completions.create(
                    model="tiny",
                    prompt="Hello",
                    max_tokens=40,
                    seed=seed,
                    temperature=1.0,
                    extra_body={"structured_outputs": outputs},
                )
                .choices[0]
                .text
            )
            assert check(text), (outputs, text)
    body = {
        "inputs": "Hello",
        "parameters": {"max_new_tokens": 30, "grammar": {"type": "regex", "value": "[0-9]{4}"}},
    }
    reply = httpx.post(f"{base}/models/tiny/generate", headers=AUTH, json=body, timeout=60)
    assert re.fullmatch("[0-9]{4}", reply.json()["generated_text"]), reply.text
    body["parameters"] |= {
        "max_new_tokens": 200,
        "grammar": {"type": "json", "value": Pet.model_json_schema()},
    }
    Pet.model_validate_json(
        httpx.post(f"{base}/models/tiny/generate", headers=AUTH, json=body, timeout=60).json()[
            "generated_text"
        ]
    )


def test_constrained_streams_leave_the_others_their_answers(sdk):
    """Constrained and unconstrained streams in one batch: the unconstrained ones answer as alone."""

    def ask(i: int, constrained: bool) -> str:
        extra = {"structured_outputs": {"json": Pet.model_json_schema()}} if constrained else {}
        prompt = f"Story {i}:"
        return (
            sdk.completions.create(
                model="tiny",
                prompt=prompt,
                max_tokens=200 if constrained else 24,
                temperature=0,
                extra_body={"ignore_eos": True, **extra},
            )
            .choices[0]
            .text
        )

    alone = [ask(i, False) for i in range(3)]
    with ThreadPoolExecutor(6) as pool:
        mixed = [pool.submit(ask, i, constrained) for constrained in (True, False) for i in range(3)]
        answers = [f.result() for f in mixed]
    assert answers[3:] == alone
    for text in answers[:3]:
        Pet.model_validate_json(text)


def test_bad_grammars_are_refused_naming_the_parameter(sdk, stack):
    for kwargs, word in [
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "strin"}},
                }
            },
            "response_format",
        ),
        ({"response_format": {"type": "json_schema"}}, "json_schema"),
        ({"extra_body": {"structured_outputs": {"regex": "(["}}}, "structured_outputs"),
        ({"extra_body": {"structured_outputs": {"regex": "a", "choice": ["b"]}}}, "exactly one"),
        ({"extra_body": {"structured_outputs": {"json": "{not json"}}}, "not JSON"),
        ({"extra_body": {"structured_outputs": {"grammar": "start: missing_rule"}}}, "structured_outputs"),
    ]:
        with pytest.raises(openai.BadRequestError, match=word):
            sdk.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=4, **kwargs)
    body = {"inputs": "x", "parameters": {"grammar": {"type": "regex", "value": "(["}}}
    reply = httpx.post(f"{stack[0]}/models/tiny/generate", headers=AUTH, json=body, timeout=30)
    assert reply.status_code == 422 and "parameters.grammar" in reply.json()["error"], reply.text


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 20},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
MULTIPLY = {  # LangChain's bind_tools body for `def multiply(a: int, b: int) -> int`
    "type": "function",
    "function": {
        "name": "multiply",
        "description": "Multiply two integers.",
        "parameters": {
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
            "type": "object",
        },
    },
}


class WeatherArgs(BaseModel):
    model_config = ConfigDict(extra="forbid")
    city: str = Field(max_length=20)
    unit: Literal["celsius", "fahrenheit"]


class MultiplyArgs(BaseModel):
    a: int
    b: int


ARGS = {"get_weather": WeatherArgs, "multiply": MultiplyArgs}


def test_required_and_named_tool_calls_validate_streamed_or_not(sdk):
    """The tiny model is random: the grammar alone makes its call valid."""
    kwargs = dict(model="tiny", messages=MESSAGES, max_tokens=120, temperature=0, tools=[WEATHER, MULTIPLY])
    for choice in ("required", {"type": "function", "function": {"name": "multiply"}}):
        reply = sdk.chat.completions.create(**kwargs, tool_choice=choice)
        message = reply.choices[0].message
        assert reply.choices[0].finish_reason == "tool_calls" and len(message.tool_calls) == 1, message
        call = message.tool_calls[0]
        ARGS[call.function.name].model_validate_json(call.function.arguments)
        if isinstance(choice, dict):
            assert call.function.name == "multiply"
        chunks = list(sdk.chat.completions.create(**kwargs, tool_choice=choice, stream=True))
        deltas = [d for c in chunks if c.choices for d in c.choices[0].delta.tool_calls or []]
        assert [d.function.name for d in deltas if d.function.name] == [call.function.name]
        assert "".join(d.function.arguments or "" for d in deltas) == call.function.arguments
        assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_agent_framework_request_shapes_are_accepted(sdk):
    """The bodies LangChain (tools, no tool_choice) and the OpenAI Agents SDK (strict tools, content
    parts, a call and its result in the history, parallel_tool_calls false, streaming with usage)
    send, through the `openai` package."""
    langchain = sdk.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "What is 3 times 4?"}],
        temperature=0.7,
        n=1,
        stream=False,
        tools=[MULTIPLY],
        max_tokens=16,
    )
    assert langchain.choices[0].finish_reason in ("stop", "length", "tool_calls")
    strict = {**WEATHER, "function": {**WEATHER["function"], "strict": True}}
    history = [
        {"role": "system", "content": "You are a weather agent."},
        {"role": "user", "content": [{"type": "text", "text": "Weather in Paris?"}]},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees, sunny"},
    ]
    chunks = list(
        sdk.chat.completions.create(
            model="tiny",
            messages=history,
            tools=[strict],
            tool_choice="auto",
            parallel_tool_calls=False,
            stream=True,
            stream_options={"include_usage": True},
            max_tokens=16,
            extra_body={"store": False},
        )
    )
    assert chunks[-1].usage.completion_tokens > 0


def test_bad_tool_requests_are_400_naming_the_parameter(sdk):
    for kwargs, word in [
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "fly"}}},
            "tool_choice",
        ),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [WEATHER, WEATHER]}, "repeat"),
        ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools"),
        (
            {"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}},
            "tool_choice",
        ),
    ]:
        with pytest.raises(openai.BadRequestError, match=word):
            sdk.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=4, **kwargs)


def test_tokenize_and_detokenize(stack, tokenizer):
    base = stack[0]

    def call(path, body, headers=AUTH):
        return httpx.post(f"{base}{path}", headers=headers, json=body, timeout=30)

    hello = call("/tokenize", {"model": "tiny", "prompt": "Hello there"}).json()
    assert hello["tokens"] == tokenizer.encode("Hello there") and hello["count"] == len(hello["tokens"])
    assert hello["max_model_len"] > 0
    chat = call("/tokenize", {"model": "tiny", "messages": MESSAGES}).json()
    assert chat["tokens"] == tokenizer.encode_chat(MESSAGES)
    assert call("/detokenize", {"model": "tiny", "tokens": chat["tokens"]}).json() == {
        "prompt": tokenizer.decode(chat["tokens"], skip_special_tokens=False)
    }
    for path, body, status, word in [
        ("/tokenize", {"model": "tiny", "prompt": "x", "messages": MESSAGES}, 400, "either"),
        ("/tokenize", {"model": "tiny"}, 400, "either"),
        ("/tokenize", {"model": "gpt-5", "prompt": "x"}, 404, "served"),
        ("/detokenize", {"model": "tiny", "tokens": [tokenizer.vocab_size]}, 400, "vocabulary"),
        ("/detokenize", {"model": "tiny", "tokens": "abc"}, 400, "tokens"),
    ]:
        reply = call(path, body)
        assert reply.status_code == status and word in reply.json()["error"]["message"], reply.text
    assert call("/tokenize", {"model": "tiny", "prompt": "x"}, headers={}).status_code == 401
    # without a model the first configured one answers, as vLLM's (lm-eval's remote tokenizer sends none)
    assert call("/tokenize", {"prompt": "Hello there"}).json()["tokens"] == hello["tokens"]
    assert call("/detokenize", {"tokens": chat["tokens"]}).json()["prompt"] == tokenizer.decode(
        chat["tokens"], skip_special_tokens=False
    )


def test_tokenizer_info(stack, tokenizer):
    base = stack[0]
    info = httpx.get(f"{base}/tokenizer_info", headers=AUTH, timeout=30)
    assert info.status_code == 200, info.text
    assert info.json() == {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": tokenizer.bos_token,
        "eos_token": tokenizer.eos_token,
        "pad_token": None,
        "chat_template": tokenizer.chat_template,
        "model_max_length": httpx.post(
            f"{base}/tokenize", headers=AUTH, json={"prompt": "x"}, timeout=30
        ).json()["max_model_len"],
        "tasks": ["generate"],  # a chat model's (server/pooling.py)
    }
    assert httpx.get(f"{base}/tokenizer_info?model=tiny", headers=AUTH, timeout=30).json() == info.json()
    unknown = httpx.get(f"{base}/tokenizer_info?model=gpt-5", headers=AUTH, timeout=30)
    assert unknown.status_code == 404 and "served" in unknown.json()["error"]["message"]
    assert httpx.get(f"{base}/tokenizer_info", timeout=30).status_code == 401


# ------------------------------------------------------------------------------------ ops


def metrics(base) -> dict:
    """Each sample by its name and labels but the model's (every sample names the one model)."""
    families = text_string_to_metric_families(httpx.get(f"{base}/metrics", headers=AUTH).text)
    samples = [s for f in families for s in f.samples]
    assert {s.labels.get("model") for s in samples} == {"tiny"}
    return {
        s.name + str(sorted((k, v) for k, v in s.labels.items() if k != "model")): s.value for s in samples
    }


def test_metrics_move_as_requests_run(stack):
    base = stack[0]
    before = metrics(base)
    reply = httpx.post(
        f"{base}/models/tiny/generate",
        headers=AUTH,
        json={"inputs": "The quick", "parameters": {"max_new_tokens": 5, "ignore_eos": True}},
    )
    assert reply.status_code == 200
    after = metrics(base)
    ok = "llm_serving_requests_total[('outcome', 'ok')]"
    assert after[ok] == before[ok] + 1
    assert after["llm_serving_generated_tokens_total[]"] == before["llm_serving_generated_tokens_total[]"] + 5
    assert (
        after["llm_serving_time_to_first_token_seconds_count[]"]
        == before["llm_serving_time_to_first_token_seconds_count[]"] + 1
    )
    assert (
        after["llm_serving_inter_token_latency_seconds_count[]"]
        >= before["llm_serving_inter_token_latency_seconds_count[]"] + 4
    )
    assert after["llm_serving_slots[]"] == 8 and after["llm_serving_running_sequences[]"] == 0
    decode = [k for k in after if k.startswith("llm_serving_agent_step_seconds_count") and "decode" in k]
    assert decode and after[decode[0]] > 0
    # the agent's own time of each decode, within the time the server saw the call take
    step, compute = (
        sorted(k for k in after if k.startswith(f"llm_serving_agent_{kind}_seconds_sum") and "decode" in k)
        for kind in ("step", "compute")
    )
    assert len(compute) == 1 and after[compute[0].replace("_sum", "_count")] == after[decode[0]]
    assert 0 < after[compute[0]] < after[step[0]]
    rejected = "llm_serving_requests_total[('outcome', 'rejected')]"
    httpx.post(f"{base}/models/tiny/generate", headers=AUTH, json={"inputs": "word " * 600})
    assert metrics(base)[rejected] == after[rejected] + 1


def test_info(stack):
    info = httpx.get(f"{stack[0]}/info", headers=AUTH).json()
    assert info["model_id"] == "tiny" and info["slots"] == 8 and info["max_input_length"] == 1535


# ------------------------------------------------------------------------------------ client


def test_python_client_sync_and_async(stack):
    base = stack[0]
    client = Client(base, "tiny", api_key=KEY)
    text = client.generate("The quick brown fox", max_new_tokens=12)
    assert text
    assert "".join(client.generate_stream("The quick brown fox", max_new_tokens=12)) == text
    assert "".join(client.generate_stream("The quick brown fox", "plain", max_new_tokens=12)) == text
    assert client.batch_size() == 0 and client.queue_depth() == 0

    async def async_run():
        async with AsyncClient(base, "tiny", api_key=KEY) as c:
            pieces = [p async for p in c.generate_stream("The quick brown fox", max_new_tokens=12)]
            return await c.generate("The quick brown fox", max_new_tokens=12), "".join(pieces)

    assert asyncio.run(async_run()) == (text, text)
    with pytest.raises(ServerError) as error:
        Client(base, "nope", api_key=KEY).generate("x")
    assert error.value.status == 404 and "served: tiny" in error.value.message
    with pytest.raises(ServerError) as error:
        Client(base, "tiny").generate("x")
    assert error.value.status == 401
    with pytest.raises(ValidationError):
        client.generate("x", max_new_tokens=-1)


def run_cli(*args):
    return subprocess.run(
        [sys.executable, "-m", "client", *args], capture_output=True, text=True, cwd=PROJECT_ROOT, timeout=60
    )


def test_command_line(stack):
    base = stack[0]
    want = Client(base, "tiny", api_key=KEY).generate("The quick brown fox", max_new_tokens=10)
    common = ["--url", base, "--model", "tiny", "--api-key", KEY, "--max-new-tokens", "10"]
    assert run_cli("The quick brown fox", *common).stdout == want + "\n"
    streamed = run_cli("The quick brown fox", *common, "--stream", "--protocol", "plain")
    assert streamed.returncode == 0 and streamed.stdout == want + "\n"
    failed = run_cli("x", "--url", base, "--model", "nope", "--api-key", KEY)
    assert failed.returncode == 1 and "404" in failed.stderr and "served: tiny" in failed.stderr


# ------------------------------------------------------------------------------------ dashboard


def test_dashboard_in_a_real_browser_under_load(stack):
    base = stack[0]
    driver = chromium_driver()
    load = [
        threading.Thread(
            target=httpx.post,
            args=(f"{base}/models/tiny/generate",),
            kwargs={
                "headers": AUTH,
                "timeout": 120,
                "json": {"inputs": f"load {i}", "parameters": {"max_new_tokens": 440, "ignore_eos": True}},
            },
        )
        for i in range(6)
    ]
    try:
        driver.get(f"{base}/dashboard?api_key={KEY}")
        for t in load:
            t.start()
        from selenium.webdriver.support.ui import WebDriverWait

        chart = lambda name: driver.find_element("id", "chart-" + name)  # noqa: E731
        WebDriverWait(driver, 60, 0.2).until(lambda d: float(chart("bs").get_attribute("data-max")) > 1)
        WebDriverWait(driver, 60, 0.2).until(
            lambda d: (
                float(chart("tps").get_attribute("data-max")) > 0
                and int(chart("tps").get_attribute("data-points")) >= 4
            )
        )
        assert driver.find_element("id", "ready").text == "ready"
        assert "up" in driver.find_element("id", "agents").text
        assert driver.find_element("id", "models").text.startswith("tiny READY")
        screenshot = PROJECT_ROOT / "output" / "dashboard.png"
        screenshot.parent.mkdir(exist_ok=True)
        assert driver.save_screenshot(str(screenshot))
        for t in load:
            t.join()
        WebDriverWait(driver, 30, 0.2).until(lambda d: float(chart("ttft").get_attribute("data-max")) > 0)
    finally:
        driver.quit()


# ------------------------------------------------------------------------------------ last


def test_ready_goes_503_when_the_agent_dies(stack):
    """Last in this module: kills the agent (restart_policy exit stops the launcher too)."""
    base, agents, _ = stack
    assert httpx.get(f"{base}/ready", headers=AUTH).json() == {"status": "ready"}
    pids = agents.agent_pids()
    agents.close()
    assert not wait_gone(pids, 20)
    response = httpx.get(f"{base}/ready", headers=AUTH, timeout=30)
    assert response.status_code == 503 and "agents not answering" in response.json()["error"]
    assert response.headers["retry-after"]
    assert httpx.get(f"{base}/health").status_code == 200
