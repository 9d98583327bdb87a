"""OpenAI's Responses API (/v1/responses) through the official `openai` package against a real agent
and `start_server.py` on the tiny model: every answer is the chat API's greedy answer for the same
conversation (plain, streamed, with a function tool, with a JSON schema, chained with
previous_response_id), and what the server cannot honour is a 400 naming it."""

import json

import openai
import pytest
from pydantic import BaseModel, Field

from agent_harness import LONG_ANSWERS_RUNTIME, free_ports, serving_stack, write_config

KEY = "responses-key"
USER = "Hello there"
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The current weather in a city.",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 20}},
        "required": ["city"],
        "additionalProperties": False,
    },
}
CHAT_WEATHER = {"type": "function", "function": {k: v for k, v in WEATHER.items() if k != "type"}}
CITY_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "country": {"type": "string", "maxLength": 12},
    },
    "required": ["name", "country"],
    "additionalProperties": False,
}


class City(BaseModel):
    name: str = Field(max_length=12)
    country: str = Field(max_length=12)


@pytest.fixture(scope="module")
def sdk(tmp_path_factory, tiny_llama_dir):
    agent_port, http_port = free_ports(2)
    path = write_config(
        tmp_path_factory.mktemp("responses"),
        tiny_llama_dir,
        [agent_port],
        runtime={**LONG_ANSWERS_RUNTIME, "max_seq_len": 1536, "attend_buckets": [64, 512, 1536]},
        agents={"restart_policy": "exit"},
        server={"port": http_port, "api_keys": [KEY], "responses_store_size": 4},
    )
    with serving_stack(path):
        yield openai.OpenAI(base_url=f"http://127.0.0.1:{http_port}/v1", api_key=KEY, max_retries=0)


def chat(sdk, messages, max_tokens=12, **kwargs):
    return sdk.chat.completions.create(
        model="tiny", messages=messages, max_tokens=max_tokens, temperature=0, **kwargs
    )


def streamed(events) -> tuple[str, object]:
    """The text of a streamed response's deltas and its last event."""
    events = list(events)
    assert events[0].type == "response.created" and [e.sequence_number for e in events] == list(
        range(len(events))
    )
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    return text, events[-1]


def test_plain_and_streamed_answers_are_the_chat_answer(sdk):
    expected = chat(sdk, [{"role": "system", "content": "You are terse."}, {"role": "user", "content": USER}])
    reply = sdk.responses.create(
        model="tiny", input=USER, instructions="You are terse.", max_output_tokens=12, temperature=0
    )
    assert reply.object == "response" and reply.output_text == expected.choices[0].message.content
    assert reply.usage.input_tokens == expected.usage.prompt_tokens
    assert reply.usage.output_tokens == expected.usage.completion_tokens
    cut = expected.choices[0].finish_reason == "length"
    assert reply.status == ("incomplete" if cut else "completed")
    if cut:
        assert reply.incomplete_details.reason == "max_output_tokens"

    kwargs = dict(model="tiny", instructions="You are terse.", max_output_tokens=12, temperature=0)
    messages = [{"role": "user", "content": [{"type": "input_text", "text": USER}]}]
    text, last = streamed(sdk.responses.create(input=messages, stream=True, **kwargs))
    assert text == reply.output_text
    assert last.type == f"response.{reply.status}" and last.response.output_text == text
    with sdk.responses.stream(input=USER, **kwargs) as stream:
        text, last = streamed(stream)
    assert text == reply.output_text and last.response.usage.output_tokens == reply.usage.output_tokens


def test_json_schema_answers_are_the_chat_answer(sdk):
    response_format = {"type": "json_schema", "json_schema": {"name": "city", "schema": CITY_SCHEMA}}
    question = [{"role": "user", "content": "Name a city."}]
    expected = chat(sdk, question, max_tokens=80, response_format=response_format)
    assert expected.choices[0].finish_reason == "stop"  # the grammar completes it
    text = {"format": {"type": "json_schema", "name": "city", "schema": CITY_SCHEMA, "strict": True}}
    reply = sdk.responses.create(model="tiny", input=question, max_output_tokens=80, temperature=0, text=text)
    assert reply.status == "completed" and reply.output_text == expected.choices[0].message.content
    with sdk.responses.stream(
        model="tiny", input=question, max_output_tokens=80, temperature=0, text=text
    ) as stream:
        final = stream.get_final_response()
    assert final.output_text == reply.output_text
    parsed = sdk.responses.parse(
        model="tiny", input=question, max_output_tokens=80, temperature=0, text_format=City
    ).output_parsed
    assert parsed == City.model_validate_json(reply.output_text)


def test_function_tool_calls_and_results_are_the_chat_answer(sdk):
    question = [{"role": "user", "content": "Weather in Paris?"}]
    expected = chat(sdk, question, max_tokens=120, tools=[CHAT_WEATHER], tool_choice="required")
    [chat_call] = expected.choices[0].message.tool_calls
    kwargs = dict(model="tiny", max_output_tokens=120, temperature=0, tools=[WEATHER], tool_choice="required")
    reply = sdk.responses.create(input=question, **kwargs)
    [call] = [item for item in reply.output if item.type == "function_call"]
    assert (call.name, call.arguments) == (chat_call.function.name, chat_call.function.arguments)
    assert call.call_id.startswith("call_") and reply.status == "completed"

    named = sdk.responses.create(
        **{**kwargs, "tool_choice": {"type": "function", "name": "get_weather"}}, input=question
    )
    assert [item.name for item in named.output if item.type == "function_call"] == ["get_weather"]
    assert named.tool_choice.type == "function" and named.tool_choice.name == "get_weather"

    with sdk.responses.stream(input=question, **kwargs) as stream:
        events = list(stream)
        final = stream.get_final_response()
    deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert deltas == call.arguments
    [streamed_call] = [item for item in final.output if item.type == "function_call"]
    assert streamed_call.arguments == call.arguments

    # The round trip: the call and its output in the input, answered freely with the tool offered.
    result = json.dumps({"celsius": 18})
    items = [
        *question,
        {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": result},
    ]
    history = [
        *question,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": call.call_id,
                    "type": "function",
                    "function": {"name": call.name, "arguments": call.arguments},
                }
            ],
        },
        {"role": "tool", "tool_call_id": call.call_id, "content": result},
    ]
    expected = chat(sdk, history, max_tokens=12, tools=[CHAT_WEATHER], tool_choice="none")
    answer = sdk.responses.create(
        model="tiny", input=items, max_output_tokens=12, temperature=0, tools=[WEATHER], tool_choice="none"
    )
    assert answer.output_text == expected.choices[0].message.content


def test_previous_response_id_chains_the_conversation(sdk):
    first = sdk.responses.create(model="tiny", input=USER, max_output_tokens=8, temperature=0)
    second = sdk.responses.create(
        model="tiny", input="And then?", previous_response_id=first.id, max_output_tokens=8, temperature=0
    )
    history = [
        {"role": "user", "content": USER},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "And then?"},
    ]
    expected = chat(sdk, history, max_tokens=8)
    assert second.output_text == expected.choices[0].message.content
    assert second.previous_response_id == first.id
    assert second.usage.input_tokens == expected.usage.prompt_tokens
    third = sdk.responses.create(  # the chain goes on through the streamed kind too
        model="tiny",
        input="Why?",
        previous_response_id=second.id,
        max_output_tokens=8,
        temperature=0,
        stream=True,
    )
    text, last = streamed(third)
    history += [{"role": "assistant", "content": second.output_text}, {"role": "user", "content": "Why?"}]
    assert text == chat(sdk, history, max_tokens=8).choices[0].message.content

    assert sdk.responses.retrieve(first.id).output_text == first.output_text
    unstored = sdk.responses.create(model="tiny", input=USER, max_output_tokens=4, temperature=0, store=False)
    with pytest.raises(openai.NotFoundError, match="previous_response_id|no response"):
        sdk.responses.create(model="tiny", input="x", previous_response_id=unstored.id, max_output_tokens=4)
    sdk.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        sdk.responses.retrieve(first.id)
    for _ in range(4):  # the store holds 4 (responses_store_size): the oldest go
        sdk.responses.create(model="tiny", input=USER, max_output_tokens=2, temperature=0)
    with pytest.raises(openai.NotFoundError):
        sdk.responses.retrieve(second.id)


def test_what_cannot_be_honoured_is_a_400_naming_it(sdk):
    for kwargs, word in [
        ({"tools": [{"type": "web_search"}]}, "web_search"),
        ({"background": True}, "background"),
        ({"reasoning": {"effort": "high"}}, "reasoning"),
        (
            {
                "input": [
                    {"role": "user", "content": [{"type": "input_image", "image_url": "http://x/y.png"}]}
                ]
            },
            "input_image",
        ),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"max_output_tokens": 100000}, "max_output_tokens"),
        ({"temperature": 3}, "temperature"),
    ]:
        with pytest.raises(openai.BadRequestError, match=word):
            sdk.responses.create(**{"model": "tiny", "input": USER, **kwargs})
