"""Qwen3.5's and Qwen3-Coder's XML tool calls (server/tool_call_qwen_xml.py, tool_calls' qwen3_xml
format): chosen from the real template, read from whole and streamed answers with each parameter
converted by its schema's type, hostile answers read in linear time, and tool_choice's grammar."""

import json
from pathlib import Path

import llguidance
import pytest

from agent.model.tokenizer import load_tokenizer
from server import tool_calls
from server.openai_schema import ChatCompletionRequest, Tool
from server.structured_output import _grammar_text
from time_limit import deadline

QWEN = tool_calls.QWEN3_XML
TEMPLATES = Path(__file__).parents[1] / "agent" / "chat_templates"
WEATHER_SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string"},
        "days": {"type": "integer"},
        "scale": {"type": "number"},
        "metric": {"type": "boolean"},
        "where": {"type": "object"},
        "hours": {"type": "array"},
        "note": {"type": ["string", "null"]},
    },
    "required": ["city", "days"],
}
TOOLS = [
    Tool.model_validate(
        {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER_SCHEMA}}
    ),
    Tool.model_validate({"type": "function", "function": {"name": "add"}}),
]


def call(name: str, **params: str) -> str:
    inner = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params.items())
    return f"<tool_call>\n<function={name}>\n{inner}</function>\n</tool_call>"


PARIS = call("get_weather", city="Paris", days="3")


def arguments(c: dict) -> dict:
    return json.loads(c["function"]["arguments"])


def names(calls: list[dict]) -> list[str]:
    return [c["function"]["name"] for c in calls]


def test_the_qwen35_template_chooses_the_xml_format():
    text = (TEMPLATES / "Qwen-Qwen3.5-4B.jinja").read_text(encoding="utf-8")
    assert tool_calls.call_format(text, "auto") == QWEN
    qwen3 = (TEMPLATES / "Qwen-Qwen3-0.6B.jinja").read_text(encoding="utf-8")
    assert tool_calls.call_format(qwen3, "auto") == tool_calls.HERMES  # JSON within the tags
    assert tool_calls.call_format(qwen3, QWEN) == QWEN


def test_a_call_is_read_and_the_text_before_it_is_content():
    content, calls = tool_calls.parse_calls("Let me check.\n\n" + PARIS, TOOLS, fmt=QWEN)
    assert content == "Let me check." and names(calls) == ["get_weather"]
    assert arguments(calls[0]) == {"city": "Paris", "days": 3}
    assert calls[0]["id"].startswith("call_") and calls[0]["type"] == "function"


def test_parameters_are_converted_by_their_schema_type():
    text = call(
        "get_weather",
        city="New York\nsecond line",
        days="-4",
        scale="2.5",
        metric="True",
        where='{"lat": 1, "lon": [2]}',
        hours="[1, 2]",
        note="null",
        extra="42",
    )
    _, calls = tool_calls.parse_calls(text, TOOLS, fmt=QWEN)
    assert arguments(calls[0]) == {
        "city": "New York\nsecond line",
        "days": -4,
        "scale": 2.5,
        "metric": True,
        "where": {"lat": 1, "lon": [2]},
        "hours": [1, 2],
        "note": None,
        "extra": "42",  # not in the schema: text
    }


def test_values_that_fail_their_conversion_stay_text_and_only_one_newline_is_taken():
    text = call("get_weather", city="\n  Paris  \n", days="three", metric="yes", where="[1]", hours="{")
    _, calls = tool_calls.parse_calls(text, TOOLS, fmt=QWEN)
    assert arguments(calls[0]) == {
        "city": "\n  Paris  \n",
        "days": "three",
        "metric": "yes",
        "where": "[1]",
        "hours": "{",
    }
    deep = call("get_weather", where="[" * 300 + "]" * 300, days="1" + "0" * 5000)
    _, calls = tool_calls.parse_calls(deep, TOOLS, fmt=QWEN)
    assert arguments(calls[0])["where"] == "[" * 300 + "]" * 300  # nested past the bound
    assert arguments(calls[0])["days"] == "1" + "0" * 5000


def test_multiple_calls_are_all_read_unless_parallel_calls_are_off():
    text = PARIS + "\n" + call("add") + "\n"
    content, calls = tool_calls.parse_calls(text, TOOLS, fmt=QWEN)
    assert content is None and names(calls) == ["get_weather", "add"] and arguments(calls[1]) == {}
    assert names(tool_calls.parse_calls(text, TOOLS, parallel=False, fmt=QWEN)[1]) == ["get_weather"]


@pytest.mark.parametrize(
    "text",
    [
        "Paris is sunny.",
        PARIS[:-1],  # unclosed
        PARIS.replace("</function>", ""),
        call("add", a="1").replace("</parameter>", ""),  # a parameter unclosed
        PARIS.replace("<function=", "<function"),
        call("unknown", a="1"),
        "<tool_call>\n" + '{"name": "add", "arguments": {}}' + "\n</tool_call>",  # Hermes's JSON
        '{"name": "add", "arguments": {}}',
        call("get_weather", city="Paris").replace("<parameter=city>", "<parameter=" + "c" * 300 + ">"),
        call("get_weather" + "x" * 300),
        PARIS.replace("<parameter=", "stray <parameter=", 1),
    ],
)
def test_malformed_calls_and_calls_of_unknown_functions_stay_text(text):
    assert tool_calls.parse_calls(text, TOOLS, fmt=QWEN) == (text, [])


def test_an_unknown_call_stays_text_beside_a_known_one():
    unknown = call("unknown", a="1")
    content, calls = tool_calls.parse_calls(unknown + "\n" + PARIS, TOOLS, fmt=QWEN)
    assert content == unknown and names(calls) == ["get_weather"]


def streamed(text: str, cut: int) -> tuple[str, str, list[dict]]:
    watcher = tool_calls.CallWatcher(TOOLS, parallel=True, fmt=QWEN)
    shown = "".join(watcher.feed(text[i : i + cut]) for i in range(0, len(text), cut))
    rest, calls = watcher.finish()
    return shown, rest, calls


@pytest.mark.parametrize("cut", [1, 2, 3, 5, 7, 11, 13, 1000])
def test_a_streamed_answer_shows_its_text_and_holds_its_calls(cut):
    before = "Let me check <the weather>. "
    for text in [before + PARIS, PARIS, before + PARIS + "\n" + call("add")]:
        shown, rest, calls = streamed(text, cut)
        assert names(calls)[0] == "get_weather" and arguments(calls[0]) == {"city": "Paris", "days": 3}
        expected = before.strip() if text.startswith(before) else ""
        assert (shown + rest).strip() == expected and "<tool" not in shown + rest
    for text in ["Paris is sunny. <tool_cal", '{"a": 1}', PARIS[:-3], call("unknown")]:
        shown, rest, calls = streamed(text, cut)
        assert calls == [] and shown + rest == text


def test_a_streamed_answer_goes_out_as_it_comes():
    watcher = tool_calls.CallWatcher(TOOLS, parallel=True, fmt=QWEN)
    assert watcher.feed('{"a": ') == '{"a": '  # no JSON call in this format: no wait
    assert watcher.feed("there <tool") == "there "
    assert watcher.feed("s> of") == "<tools> of"
    assert watcher.feed(" <tool_call>\n<function=add>") == " "


def test_hostile_answers_are_read_in_linear_time():
    with deadline(10):
        for text in [
            "<tool_call>" * 50_000,
            "<tool_call>\n<function=add>\n" + "<parameter=a>\n" * 50_000 + "</function>\n</tool_call>",
            "<tool_call>\n<function=add>\n" + "<parameter=" * 50_000 + "</function>\n</tool_call>",
            "<tool_call>\n<function=" + "x" * 200_000 + "\n</tool_call>",
            "<tool_call>\n<function=add>\n" + " " * 200_000 + "</tool_call>",
            call("add")[:-1] * 20_000,  # no </tool_call> ever closes
            "<tool_call>\n<function=add>\n</parameter>" * 50_000 + "</tool_call>",
        ]:
            assert tool_calls.parse_calls(text, TOOLS, fmt=QWEN) == (text, [])
            shown, rest, calls = streamed(text, 5)
            assert calls == [] and shown + rest == text
        many = call("get_weather", city="x" * 100_000, days="1" * 1000, where="{" * 100_000)
        assert names(tool_calls.parse_calls(many * 3, TOOLS, fmt=QWEN)[1]) == ["get_weather"] * 3


def request(**body) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate(
        {
            "model": "m",
            "tools": [t.model_dump() for t in TOOLS],
            "messages": [{"role": "user", "content": "?"}],
            **body,
        }
    )


def accepts(spec, tokenizer, text: str) -> bool:
    llg = llguidance.LLTokenizer(tokenizer.tokenizer.to_str(), n_vocab=tokenizer.vocab_size)
    matcher = llguidance.LLMatcher(llg, _grammar_text(spec), log_level=0)
    assert not matcher.is_error(), matcher.get_error()
    return matcher.consume_tokens(tokenizer.encode(text, add_special_tokens=False)) and matcher.is_accepting()


def test_the_grammar_is_one_xml_call_with_the_required_parameters(tiny_llama_dir):
    tokenizer = load_tokenizer(tiny_llama_dir)
    named = tool_calls.call_grammar(
        request(tool_choice={"type": "function", "function": {"name": "get_weather"}}), QWEN
    )
    assert named is not None
    code = "if a </b> c:\n  <parameter=x>\n"
    for good in [PARIS, call("get_weather", city=code, days="12"), call("get_weather", city="", days="0")]:
        assert accepts(named, tokenizer, good), good
        assert tool_calls.parse_calls(good, TOOLS, fmt=QWEN)[1]  # what the grammar lets through is a call
    for bad in [
        call("add"),  # not the named function
        call("get_weather", city="Paris"),  # a required parameter missing
        call("get_weather", city="Paris", days="three"),
        call("get_weather", days="3", city="Paris"),
        call("get_weather", city="Pa</parameter>ris", days="3"),
        PARIS + "\n" + PARIS,
        "Sure. " + PARIS,
    ]:
        assert not accepts(named, tokenizer, bad), bad
    required = tool_calls.call_grammar(request(tool_choice="required"), QWEN)
    assert required is not None
    assert accepts(required, tokenizer, call("add")) and accepts(required, tokenizer, PARIS)
    assert not accepts(required, tokenizer, call("unknown"))
