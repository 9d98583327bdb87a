"""OpenAI's Responses API (/v1/responses) through the official `openai` package against a real agent
and `start_server.py` on the tiny model: every answer is the chat API's greedy answer for the same
conversation (plain, streamed, with a function tool, with a JSON schema, chained with
previous_response_id), and what the server cannot honour is a 400 naming it. The store of kept
responses is bounded (in bytes, in all, per entry and per client: one client's flood of large
responses neither grows the server nor evicts another's); `metadata` and `user` are bounded as
OpenAI bounds them; `cache_salt`, `priority` and `speculate` reach the chat request."""

import json

import httpx
import openai
import psutil
import pytest
from prometheus_client.parser import text_string_to_metric_families
from pydantic import BaseModel, Field

from agent_harness import LONG_ANSWERS_RUNTIME, free_ports, serving_stack, write_config
from attack_watch import under_attack
from waiting import wait_until

KEY, OTHER_KEY = "responses-key", "other-responses-key"
CLIENT_ENTRIES = 4  # server.responses_client_entries
ENTRY_BYTES = 1 << 20  # server.responses_entry_bytes
CLIENT_BYTES = 4 << 20  # server.responses_client_bytes
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
def stack(tmp_path_factory, tiny_llama_dir):
    """Agent + server with two keys; yields (base URL, the server's process)."""
    agent_port, http_port = free_ports(2)
    path = write_config(
        tmp_path_factory.mktemp("responses"),
        tiny_llama_dir,
        [agent_port],
        runtime={**LONG_ANSWERS_RUNTIME, "max_seq_len": 1536, "attend_buckets": [64, 512, 1536]},
        agents={"restart_policy": "exit"},
        server={
            "port": http_port,
            "api_keys": [KEY, OTHER_KEY],
            "max_body_bytes": 2 << 20,
            "responses_store_size": 64,
            "responses_client_entries": CLIENT_ENTRIES,
            "responses_store_bytes": 8 << 20,
            "responses_client_bytes": CLIENT_BYTES,
            "responses_entry_bytes": ENTRY_BYTES,
        },
    )
    with serving_stack(path) as (_agents, server):
        yield f"http://127.0.0.1:{http_port}", psutil.Process(server.process.pid)


@pytest.fixture(scope="module")
def sdk(stack):
    return openai.OpenAI(base_url=f"{stack[0]}/v1", api_key=KEY, max_retries=0)


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
    for _ in range(CLIENT_ENTRIES):  # a client keeps 4 (responses_client_entries): its oldest go
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


def create(base: str, key: str = KEY, **body) -> httpx.Response:
    body = {"model": "tiny", "input": USER, "max_output_tokens": 2, "temperature": 0, **body}
    headers = {"Authorization": f"Bearer {key}"}
    return httpx.post(f"{base}/v1/responses", json=body, headers=headers, timeout=120)


def final_event(base: str, **body) -> dict:
    """A streamed response's last event."""
    body = {"model": "tiny", "input": USER, "max_output_tokens": 2, "temperature": 0, "stream": True, **body}
    headers = {"Authorization": f"Bearer {KEY}"}
    with httpx.stream("POST", f"{base}/v1/responses", json=body, headers=headers, timeout=120) as reply:
        assert reply.status_code == 200, reply.read()
        data = [line.removeprefix("data:") for line in reply.iter_lines() if line.startswith("data:")]
    return json.loads(data[-1])


def padded(size: int) -> dict:
    """A `text` whose format holds `size` bytes in a key of its own: kept and echoed, never tokenized."""
    return {"format": {"type": "text", "padding": "x" * size}}


def test_metadata_and_user_are_bounded_as_openai_bounds_them(stack):
    base, _ = stack
    fits = {f"k{n:02d}" + "k" * 61: "v" * 512 for n in range(16)}  # 16 keys of 64, values of 512
    reply = create(base, metadata=fits, user="u" * 256)
    assert reply.status_code == 200 and reply.json()["metadata"] == fits
    for body in [
        {"metadata": {**fits, "one-more": "v"}},
        {"metadata": {"k" * 65: "v"}},
        {"metadata": {"k": "v" * 513}},
        {"user": "u" * 257},
    ]:
        refused = create(base, **body)
        assert refused.status_code == 400 and refused.json()["error"]["param"] == next(iter(body)), body


def test_a_response_too_large_to_keep_says_so_and_is_not_kept(stack, sdk):
    base, _ = stack
    reply = create(base, text=padded(ENTRY_BYTES))
    assert reply.status_code == 200, reply.text
    body = reply.json()
    assert body["store"] is False and "responses_entry_bytes" in body["store_refused"]
    assert body["text"]["format"]["padding"] == "x" * ENTRY_BYTES  # answered whole all the same
    with pytest.raises(openai.NotFoundError):
        sdk.responses.retrieve(body["id"])
    with pytest.raises(openai.NotFoundError, match="previous_response_id|no response"):
        sdk.responses.create(model="tiny", input="x", previous_response_id=body["id"], max_output_tokens=2)
    streamed = final_event(base, text=padded(ENTRY_BYTES))["response"]
    assert streamed["store"] is False and "responses_entry_bytes" in streamed["store_refused"]
    with pytest.raises(openai.NotFoundError):
        sdk.responses.retrieve(streamed["id"])
    kept = final_event(base)["response"]  # a small one is kept, and says so
    assert kept["store"] is True and "store_refused" not in kept
    assert sdk.responses.retrieve(kept["id"]).id == kept["id"]


def test_one_clients_flood_neither_grows_the_server_nor_evicts_another_clients_responses(stack, sdk):
    """Another client floods with responses of 0.9 MB each (in an extra key of `text.format`, which
    the prompt budget never bounds): it keeps only its quota, and evicts only its own."""
    base, server = stack
    flood, flood_bytes = 70, 900_000  # more than the store holds: 64 MB unbounded
    kept = sdk.responses.create(model="tiny", input=USER, max_output_tokens=8, temperature=0)
    question = [{"role": "user", "content": "Tell me a long story."}]

    def victim() -> str:
        stream = sdk.chat.completions.create(
            model="tiny",
            messages=question,
            max_tokens=250,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        return "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)

    expected = victim()
    assert create(base, OTHER_KEY, text=padded(flood_bytes)).status_code == 200  # the allocator warmed
    rss = server.memory_info().rss
    with under_attack(base, victim, expected, name="responses store flood"):
        ids = []
        for _ in range(flood):
            reply = create(base, OTHER_KEY, text=padded(flood_bytes))
            assert reply.status_code == 200 and reply.json()["store"] is True, reply.text[:200]
            ids.append(reply.json()["id"])
    # The flooder's quota, and room for the allocator's slack: once the last replies' buffers are
    # freed (a server that kept every response never gets there).
    wait_until(
        lambda: server.memory_info().rss - rss < 4 * CLIENT_BYTES,
        10,
        f"the server's RSS within {4 * CLIENT_BYTES >> 20} MiB of its size before the flood",
    )
    assert sdk.responses.retrieve(kept.id).output_text == kept.output_text
    chained = sdk.responses.create(
        model="tiny", input="And then?", previous_response_id=kept.id, max_output_tokens=2, temperature=0
    )
    assert chained.previous_response_id == kept.id
    other = {"Authorization": f"Bearer {OTHER_KEY}"}
    assert httpx.get(f"{base}/v1/responses/{ids[-1]}", headers=other).json()["text"] == padded(flood_bytes)
    assert httpx.get(f"{base}/v1/responses/{ids[0]}", headers=other).status_code == 404  # its own went


def prefix_hits(base: str) -> float:
    text = httpx.get(f"{base}/metrics", headers={"Authorization": f"Bearer {KEY}"}, timeout=30).text
    return sum(
        s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == "llm_serving_prefix_cache_hits_total"
    )


def test_cache_salt_priority_and_speculate_reach_the_chat_request(stack):
    """A salted prompt shares no prefix-cache block with the same prompt unsalted; a priority on
    this first-come-first-served server, or a bad value, is a 400 naming it, as on chat."""
    base, _ = stack
    prompt = "Salted prompts share no cached blocks with unsalted ones. " * 8

    def hits(**body) -> float:
        before = prefix_hits(base)
        reply = create(base, input=prompt, **body)
        assert reply.status_code == 200, reply.text
        return prefix_hits(base) - before

    hits()
    assert hits() > 0  # the prompt's blocks are cached
    assert hits(cache_salt="tenant-a") == 0
    assert hits(cache_salt="tenant-a") > 0
    assert hits(cache_salt="tenant-a", speculate=False) > 0
    for body in [{"priority": 1}, {"priority": 10**9}, {"cache_salt": ""}, {"speculate": "maybe"}]:
        refused = create(base, **body)
        assert refused.status_code == 400 and refused.json()["error"]["param"] == next(iter(body)), body
