"""Anthropic's Messages API (/v1/messages) through the official `anthropic` package against a real
agent and `start_server.py` on the tiny model, its key sent as `x-api-key`: answers are the chat
API's greedy answers for the same conversation, streamed or not, a tool use round trip with its
tool_result, count_tokens, and errors in Anthropic's shape; this server's `cache_salt`, `priority`
and `speculate` reach the chat request."""

import json

import anthropic
import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from agent_harness import LONG_ANSWERS_RUNTIME, free_ports, serving_stack, write_config

KEY = "anthropic-key"
GREEDY = {"temperature": 0}  # the `anthropic` package of 2026 has no sampling arguments of its own
SYSTEM = "You are terse."
QUESTION = [{"role": "user", "content": "Hello there"}]
WEATHER = {
    "name": "get_weather",
    "description": "The current weather in a city.",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 20}},
        "required": ["city"],
        "additionalProperties": False,
    },
}
CHAT_WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": WEATHER["description"],
        "parameters": WEATHER["input_schema"],
    },
}


@pytest.fixture(scope="module")
def stack(tmp_path_factory, tiny_llama_dir):
    agent_port, http_port = free_ports(2)
    path = write_config(
        tmp_path_factory.mktemp("anthropic"),
        tiny_llama_dir,
        [agent_port],
        runtime={**LONG_ANSWERS_RUNTIME, "max_seq_len": 1536, "attend_buckets": [64, 512, 1536]},
        agents={"restart_policy": "exit"},
        server={"port": http_port, "api_keys": [KEY]},
    )
    with serving_stack(path):
        yield f"http://127.0.0.1:{http_port}"


@pytest.fixture(scope="module")
def claude(stack):
    return anthropic.Anthropic(base_url=stack, api_key=KEY, max_retries=0)


@pytest.fixture(scope="module")
def sdk(stack):
    return openai.OpenAI(base_url=f"{stack}/v1", api_key=KEY, max_retries=0)


def chat(sdk, messages, max_tokens=12, **kwargs):
    return sdk.chat.completions.create(
        model="tiny", messages=messages, max_tokens=max_tokens, temperature=0, **kwargs
    )


def test_text_answers_streamed_or_not_are_the_chat_answer(claude, sdk):
    expected = chat(sdk, [{"role": "system", "content": SYSTEM}, *QUESTION])
    reply = claude.messages.create(
        model="tiny", system=SYSTEM, messages=QUESTION, max_tokens=12, extra_body=GREEDY
    )
    assert reply.type == "message" and reply.role == "assistant"
    assert reply.content[0].type == "text" and reply.content[0].text == expected.choices[0].message.content
    assert (
        reply.stop_reason == {"length": "max_tokens", "stop": "end_turn"}[expected.choices[0].finish_reason]
    )
    assert reply.usage.input_tokens == expected.usage.prompt_tokens
    assert reply.usage.output_tokens == expected.usage.completion_tokens
    count = claude.messages.count_tokens(model="tiny", system=SYSTEM, messages=QUESTION)
    assert count.input_tokens == expected.usage.prompt_tokens

    with claude.messages.stream(
        model="tiny", system=SYSTEM, messages=QUESTION, max_tokens=12, extra_body=GREEDY
    ) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == reply.content[0].text and final.content[0].text == text
    assert final.stop_reason == reply.stop_reason and final.usage.output_tokens == reply.usage.output_tokens
    events = [
        e.type for e in claude.messages.create(model="tiny", messages=QUESTION, max_tokens=4, stream=True)
    ]
    assert events[0] == "message_start" and events[-2:] == ["message_delta", "message_stop"]
    assert "content_block_start" in events and "content_block_delta" in events


def test_stop_sequences_end_the_answer_and_are_named(claude):
    full = (
        claude.messages.create(model="tiny", messages=QUESTION, max_tokens=20, extra_body=GREEDY)
        .content[0]
        .text
    )
    stop = full[6:9]
    assert len(full) > 9 and stop.strip()
    cut = claude.messages.create(
        model="tiny", messages=QUESTION, max_tokens=20, extra_body=GREEDY, stop_sequences=[stop]
    )
    assert cut.content[0].text == full[: full.index(stop)]
    assert (cut.stop_reason, cut.stop_sequence) == ("stop_sequence", stop)


def test_tool_use_round_trip_with_tool_result(claude, sdk):
    question = [{"role": "user", "content": "Weather in Paris?"}]
    expected = chat(sdk, question, max_tokens=120, tools=[CHAT_WEATHER], tool_choice="required")
    [chat_call] = expected.choices[0].message.tool_calls
    kwargs = dict(
        model="tiny", max_tokens=120, extra_body=GREEDY, tools=[WEATHER], tool_choice={"type": "any"}
    )
    reply = claude.messages.create(messages=question, **kwargs)
    [use] = [block for block in reply.content if block.type == "tool_use"]
    assert reply.stop_reason == "tool_use" and use.name == chat_call.function.name
    assert use.input == json.loads(chat_call.function.arguments) and use.id.startswith("toolu_")
    with claude.messages.stream(messages=question, **kwargs) as stream:
        final = stream.get_final_message()
    [streamed] = [block for block in final.content if block.type == "tool_use"]
    assert (streamed.name, streamed.input, final.stop_reason) == (use.name, use.input, "tool_use")

    history = [
        *question,
        {
            "role": "assistant",
            "content": [{"type": "tool_use", "id": use.id, "name": use.name, "input": use.input}],
        },
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "18 degrees"}],
        },
    ]
    chat_history = [
        *question,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": use.id,
                    "type": "function",
                    "function": {"name": use.name, "arguments": chat_call.function.arguments},
                }
            ],
        },
        {"role": "tool", "tool_call_id": use.id, "content": "18 degrees"},
    ]
    expected = chat(sdk, chat_history, max_tokens=12, tools=[CHAT_WEATHER], tool_choice="none")
    answer = claude.messages.create(
        model="tiny",
        messages=history,
        max_tokens=12,
        extra_body=GREEDY,
        tools=[WEATHER],
        tool_choice={"type": "none"},
    )
    assert answer.content[0].text == expected.choices[0].message.content


def test_output_config_format_is_the_chat_json_schema_answer(claude, sdk):
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 12}},
        "required": ["city"],
        "additionalProperties": False,
    }
    response_format = {"type": "json_schema", "json_schema": {"name": "output", "schema": schema}}
    expected = chat(sdk, QUESTION, max_tokens=60, response_format=response_format)
    reply = claude.messages.create(
        model="tiny",
        messages=QUESTION,
        max_tokens=60,
        extra_body=GREEDY,
        output_config={"format": {"type": "json_schema", "schema": schema}},
    )
    assert reply.content[0].text == expected.choices[0].message.content and reply.stop_reason == "end_turn"


def test_errors_come_in_anthropics_shape(stack, claude):
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=stack, api_key="wrong", max_retries=0).messages.create(
            model="tiny", messages=QUESTION, max_tokens=4
        )
    with pytest.raises(anthropic.NotFoundError, match="served: tiny"):
        claude.messages.create(model="claude-opus-9", messages=QUESTION, max_tokens=4)
    for kwargs, word in [
        ({"extra_body": {"temperature": 1.5}}, "temperature"),
        ({"output_config": {"effort": "high"}}, "effort"),
        ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "web_search"),
        (
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [{"type": "image", "source": {"type": "url", "url": "http://x"}}],
                    }
                ]
            },
            "image",
        ),
        ({"max_tokens": 5000}, "max_tokens"),
    ]:
        with pytest.raises(anthropic.BadRequestError, match=word):
            claude.messages.create(**{"model": "tiny", "messages": QUESTION, "max_tokens": 4, **kwargs})
    reply = httpx.post(
        f"{stack}/v1/messages", headers={"x-api-key": KEY}, json={"model": "tiny", "messages": QUESTION}
    )
    assert reply.status_code == 400
    body = reply.json()
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    assert "max_tokens" in body["error"]["message"]
    assert httpx.post(f"{stack}/v1/messages", json={}).json()["error"]["type"] == "authentication_error"


def prefix_hits(base: str) -> float:
    text = httpx.get(f"{base}/metrics", headers={"x-api-key": KEY}, timeout=30).text
    return sum(
        s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == "llm_serving_prefix_cache_hits_total"
    )


def test_cache_salt_priority_and_speculate_reach_the_chat_request(stack, claude):
    """A salted prompt shares no prefix-cache block with the same prompt unsalted; a priority on
    this first-come-first-served server, or a bad value, is a 400 naming it, as on chat."""
    prompt = [{"role": "user", "content": "Salted messages share no cached blocks with unsalted ones. " * 8}]

    def hits(**extra) -> float:
        before = prefix_hits(stack)
        claude.messages.create(model="tiny", messages=prompt, max_tokens=2, extra_body={**GREEDY, **extra})
        return prefix_hits(stack) - before

    hits()
    assert hits() > 0  # the prompt's blocks are cached
    assert hits(cache_salt="tenant-a") == 0
    assert hits(cache_salt="tenant-a") > 0
    assert hits(cache_salt="tenant-a", speculate=False) > 0
    for extra, word in [
        ({"priority": 1}, "scheduling_policy"),
        ({"priority": 10**9}, "priority"),
        ({"cache_salt": ""}, "cache_salt"),
        ({"speculate": "maybe"}, "speculate"),
    ]:
        with pytest.raises(anthropic.BadRequestError, match=word):
            claude.messages.create(model="tiny", messages=QUESTION, max_tokens=2, extra_body=extra)
