"""Reading tool calls out of answers (server/tool_calls.py): Hermes/Qwen tags, Llama 3 JSON, the
streamed text held back around a call, and the prompt for templates without tools."""

import json

import pytest

from server import tool_calls
from server.openai_schema import ChatCompletionRequest, Tool

TOOLS = [
    Tool.model_validate(
        {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
    ),
    Tool.model_validate({"type": "function", "function": {"name": "add"}}),
]


def call_text(name: str, arguments: dict) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {json.dumps(arguments)}}}\n</tool_call>'


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
