"""Reading tool calls out of answers (server/tool_calls.py): Hermes/Qwen tags, Llama 3 JSON, the
streamed text held back around a call, and the prompt for templates without tools; hostile answers
and histories (unclosed tags, JSON nested past the bound) read in linear time, without a 500."""

import json

import pytest

from server import tool_calls
from server.errors import ApiError
from server.openai_schema import ChatCompletionRequest, Tool
from server.request_body import MAX_JSON_DEPTH
from time_limit import deadline

TOOLS = [
    Tool.model_validate(
        {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
    ),
    Tool.model_validate({"type": "function", "function": {"name": "add"}}),
]


def call_text(name: str, arguments: dict | str) -> str:
    arguments = arguments if isinstance(arguments, str) else json.dumps(arguments)
    return f'<tool_call>\n{{"name": "{name}", "arguments": {arguments}}}\n</tool_call>'


def nested(depth: int) -> str:
    """A JSON value `depth` levels deep: {"a": [[...]]}."""
    return '{"a": ' + "[" * (depth - 1) + "]" * (depth - 1) + "}"


def test_tagged_calls_are_read_and_the_rest_is_content():
    text = "Let me check. " + call_text("get_weather", {"city": "Paris"}) + call_text("add", {"a": 1})
    content, calls = tool_calls.parse_calls(text, TOOLS)
    assert content == "Let me check."
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("get_weather", {"city": "Paris"}),
        ("add", {"a": 1}),
    ]
    assert all(c["id"].startswith("call_") and c["type"] == "function" for c in calls)
    assert len(tool_calls.parse_calls(text, TOOLS, parallel=False)[1]) == 1


@pytest.mark.parametrize(
    "text",
    [
        "No tools needed.",
        call_text("fly", {"to": "Mars"}),  # not an offered function
        "<tool_call>\n{not json}\n</tool_call>",
        '<tool_call>\n{"name": "add", "arguments": [1, 2]}\n</tool_call>',  # arguments not an object
    ],
)
def test_text_that_is_no_valid_call_stays_content(text):
    assert tool_calls.parse_calls(text, TOOLS) == (text, [])


def test_a_whole_answer_that_is_one_json_call_is_a_call():
    """Llama 3 style: {"name": ..., "parameters": ...} as the whole answer."""
    content, calls = tool_calls.parse_calls(' {"name": "add", "parameters": {"a": 2}} ', TOOLS)
    assert content is None and json.loads(calls[0]["function"]["arguments"]) == {"a": 2}


@pytest.mark.parametrize("cut", [1, 3, 7, 12])
def test_streamed_text_never_shows_a_call(cut):
    text = "Sure. " + call_text("add", {"a": 1}) + " done"
    watcher = tool_calls.CallWatcher(TOOLS, parallel=True)
    shown = "".join(watcher.feed(text[i : i + cut]) for i in range(0, len(text), cut))
    rest, calls = watcher.finish()
    assert shown + rest == "Sure. " and len(calls) == 1
    plain = tool_calls.CallWatcher(TOOLS, parallel=True)
    shown = "".join(plain.feed(p) for p in ["a <tool", "_x> b"])
    assert shown + plain.finish()[0] == "a <tool_x> b"  # a tag's start that was not one goes out


def test_templates_without_tools_get_them_in_a_system_message():
    req = ChatCompletionRequest.model_validate(
        {
            "model": "m",
            "tools": [t.model_dump() for t in TOOLS],
            "messages": [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Weather?"},
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {
                            "id": "c1",
                            "type": "function",
                            "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
                        }
                    ],
                },
                {"role": "tool", "tool_call_id": "c1", "content": "5 C"},
            ],
        }
    )
    messages = tool_calls.template_messages(req, template_takes_tools=False)
    assert messages[0]["role"] == "system" and '"name": "get_weather"' in messages[0]["content"]
    assert messages[0]["content"].endswith("Be brief.")
    assert tool_calls.parse_calls(messages[2]["content"], TOOLS)[1][0]["function"]["name"] == "get_weather"
    assert messages[3] == {"role": "tool", "content": "<tool_response>\n5 C\n</tool_response>"}
    none = req.model_copy(update={"tool_choice": "none"})
    assert tool_calls.template_messages(none, False)[0]["content"] == "Be brief."


@pytest.mark.parametrize(
    "text",
    [
        "<tool_call>" + " " * 200_000,  # the answer: a tag opened, never closed
        "<tool_call> " * 20_000,  # many opened, none closed
        "x <tool_call>\n" + "\n" * 100_000 + "</tool_call" + " " * 100_000,
    ],
)
def test_an_unclosed_tag_is_read_in_linear_time(text):
    """The pattern this replaced backtracked in cubic time: 2,000 spaces cost seconds, these
    hours. A scan reads them in a millisecond; the deadline only catches a return of the pattern."""
    with deadline(10):
        assert tool_calls.parse_calls(text, TOOLS) == (text.strip(), [])
        watcher = tool_calls.CallWatcher(TOOLS, parallel=True)
        shown = "".join(watcher.feed(text[i : i + 4]) for i in range(0, len(text), 4))
        assert shown + watcher.finish()[0] == text
        spaced = (
            "<tool_call>"
            + " " * 100_000
            + call_text("add", {"a": 1})[11:-12]
            + " " * 100_000
            + "</tool_call>"
        )
        content, calls = tool_calls.parse_calls(spaced, TOOLS)
    assert content is None and json.loads(calls[0]["function"]["arguments"]) == {"a": 1}


def test_answers_nested_past_the_bound_stay_text():
    """json.loads raised RecursionError on the first (only ValueError was caught): a 500."""
    for text in [
        "[" * 1000 + "]" * 1000,
        call_text("add", "[" * 3000 + "]" * 3000),
        call_text("add", nested(MAX_JSON_DEPTH)),  # the call's value is one level deeper
    ]:
        assert tool_calls.parse_calls(text, TOOLS) == (text, [])
        watcher = tool_calls.CallWatcher(TOOLS, parallel=True)
        assert watcher.feed(text) + watcher.finish()[0] == text
    _, calls = tool_calls.parse_calls(call_text("add", nested(MAX_JSON_DEPTH - 1)), TOOLS)
    assert json.loads(calls[0]["function"]["arguments"]) == json.loads(nested(MAX_JSON_DEPTH - 1))


def history_with_arguments(arguments: str) -> ChatCompletionRequest:
    call = {"id": "c1", "type": "function", "function": {"name": "add", "arguments": arguments}}
    return ChatCompletionRequest.model_validate(
        {
            "model": "m",
            "tools": [t.model_dump() for t in TOOLS],
            "messages": [
                {"role": "user", "content": "Add."},
                {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "c1", "content": "3"},
            ],
        }
    )


def test_history_arguments_nested_too_deep_are_a_400():
    """json.loads raised RecursionError, which only ValueError's handler missed: a 500."""
    with pytest.raises(ApiError) as refused:
        tool_calls.template_messages(history_with_arguments("[" * 3000 + "]" * 3000), False)
    assert refused.value.status == 400 and f"deeper than {MAX_JSON_DEPTH} levels" in refused.value.message
    with pytest.raises(ApiError):
        tool_calls.template_messages(history_with_arguments(nested(MAX_JSON_DEPTH + 1)), False)
    kept = tool_calls.template_messages(history_with_arguments(nested(MAX_JSON_DEPTH)), False)
    assert json.loads(nested(MAX_JSON_DEPTH)) == json.loads(kept[2]["content"].split("\n")[1])["arguments"]
    as_sent = tool_calls.template_messages(history_with_arguments("[[not json"), False)
    assert '"arguments": "[[not json"' in as_sent[2]["content"]  # the model sees what was sent
