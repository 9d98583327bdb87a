"""Mistral's tool call format through a real agent and `start_server.py`, read with the official
`openai` package: the tiny model (random weights) gets Mistral Nemo's chat template, from which
`model.tool_call_parser: auto` picks `mistral`. Structured output forces the answers'
text (a regex), as tests/integration/server/test_reasoning_api.py does; tool_choice required holds
the answer to a call by the format's grammar."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import openai
import pytest

from agent_harness import LONG_ANSWERS_RUNTIME, free_ports, serving_stack, write_config

TEMPLATES = Path(__file__).parents[2] / "unit" / "agent" / "chat_templates"

# the real one, from llama.cpp's models/templates (tests/unit/agent/chat_templates/README.md)
MISTRAL_NEMO = (TEMPLATES / "mistralai-Mistral-Nemo-Instruct-2407.jinja").read_text(encoding="utf-8")
EOS = "<|im_end|>"  # the tiny vocabulary's
RUNTIME = {**LONG_ANSWERS_RUNTIME, "max_seq_len": 1536, "attend_buckets": [64, 512, 1536]}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
ASK = [{"role": "user", "content": "Weather in Paris?"}]
PARIS = '{"name": "get_weather", "arguments": {"city": "Paris"}}'


@pytest.fixture(scope="module")
def url(tmp_path_factory, tiny_llama_dir):
    base = tmp_path_factory.mktemp("mistral")
    directory = base / "model"
    shutil.copytree(tiny_llama_dir, directory)
    config = {"chat_template": MISTRAL_NEMO, "bos_token": "<|endoftext|>", "eos_token": EOS}
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    agent_port, http_port = free_ports(2)
    path = write_config(base, directory, [agent_port], runtime=RUNTIME, server={"port": http_port})
    with serving_stack(path):
        yield f"http://127.0.0.1:{http_port}"


def sdk(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)


def literal(text: str) -> str:
    """`text` as a regex that matches only itself."""
    return "".join("\\" + c if c in "[]{}()|.*+?^$\\" else c for c in text)


def forced(text: str) -> dict:
    return {
        "model": "tiny",
        "messages": ASK,
        "tools": [WEATHER],
        "temperature": 0,
        "max_tokens": 300,
        "extra_body": {"structured_outputs": {"regex": literal(text)}},
    }


def streamed(client: openai.OpenAI, **body) -> tuple[str, list, str | None]:
    content, calls, reason = "", [], None
    for chunk in client.chat.completions.create(stream=True, **body):
        for choice in chunk.choices:
            content += choice.delta.content or ""
            calls += choice.delta.tool_calls or []
            reason = choice.finish_reason or reason
    return content, calls, reason


@pytest.mark.parametrize(
    "answer",
    [
        "Checking. [TOOL_CALLS][" + PARIS + "]",  # tokenizers before v11
        'Checking. [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}',  # v11+
    ],
)
def test_a_mistral_call_is_a_tool_call_whole_and_streamed(url, answer):
    client = sdk(url)
    choice = client.chat.completions.create(**forced(answer)).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Checking."
    [call] = choice.message.tool_calls or []
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}
    assert len(call.id) == 9 and call.id.isalnum()  # as the template wants it back
    content, calls, reason = streamed(client, **forced(answer))
    assert content == "Checking. " and reason == "tool_calls"  # nothing of the call leaks
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris"})
    ]


def test_a_malformed_mistral_call_is_text(url):
    client = sdk(url)
    answer = 'Checking. [TOOL_CALLS]get_weather[ARGS]{"city": Paris}'
    choice = client.chat.completions.create(**forced(answer)).choices[0]
    assert choice.finish_reason == "stop" and choice.message.content == answer
    assert not choice.message.tool_calls
    assert streamed(client, **forced(answer)) == (answer, [], "stop")


def test_tool_choice_required_holds_the_answer_to_a_mistral_call(url):
    client = sdk(url)
    # a city from an enum: a random model's call ends
    city = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"]}
    short = {"type": "function", "function": {"name": "get_weather", "parameters": city}}
    body = dict(
        model="tiny", messages=ASK, tools=[short], tool_choice="required", temperature=0, max_tokens=1000
    )
    choice = client.chat.completions.create(**body).choices[0]
    assert choice.finish_reason == "tool_calls"
    [call] = choice.message.tool_calls or []
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments)["city"] in ("Paris", "Rome")
    content, calls, reason = streamed(client, **body)
    assert content == "" and reason == "tool_calls" and [c.function.name for c in calls] == ["get_weather"]


def test_a_call_goes_back_through_the_template_with_its_result(url):
    """The call as the answer gave it, sent back with its result: the real template takes its id
    (it raises on any id but 9 letters and digits, a 400)."""
    client = sdk(url)
    call = client.chat.completions.create(**forced("[TOOL_CALLS][" + PARIS + "]")).choices[0].message
    history = [
        *ASK,
        call.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.tool_calls[0].id, "content": '{"temperature": 21}'},
    ]
    answer = client.chat.completions.create(model="tiny", messages=history, tools=[WEATHER], max_tokens=4)
    assert answer.choices[0].finish_reason in ("stop", "length")
