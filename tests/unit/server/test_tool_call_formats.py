"""Each family's tool call format (server/tool_calls.py): which one a real chat template teaches
(tests/unit/agent/chat_templates/), Llama 3's JSON calls read from whole answers and streams, its
grammar for tool_choice required, and a history's calls written back through Llama 3.1's template;
hostile answers read in linear time."""

import json
from pathlib import Path

import llguidance
import pytest

from agent.model.chat_template import ChatTemplate
from agent.model.tokenizer import load_tokenizer
from server import tool_calls
from server.openai_schema import ChatCompletionRequest, Tool
from server.structured_output import _grammar_text
from time_limit import deadline

TOOLS = [
    Tool.model_validate(
        {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
    ),
    Tool.model_validate({"type": "function", "function": {"name": "add"}}),
]
TEMPLATES = Path(__file__).parents[1] / "agent" / "chat_templates"
LLAMA3 = tool_calls.LLAMA3_JSON
WEATHER = '{"name": "get_weather", "parameters": {"city": "Paris"}}'


def template(name: str) -> str:
    return (TEMPLATES / name).read_text(encoding="utf-8")


@pytest.mark.parametrize(
    ("name", "fmt"),
    [
        ("meta-llama-Llama-3.1-8B-Instruct.jinja", LLAMA3),
        ("meta-llama-Llama-3.2-3B-Instruct.jinja", LLAMA3),
        ("Qwen-Qwen2.5-7B-Instruct.jinja", tool_calls.HERMES),
        ("Qwen-Qwen3-0.6B.jinja", tool_calls.HERMES),
        ("microsoft-Phi-3.5-mini-instruct.jinja", tool_calls.HERMES),  # no tools: the system prompt's
    ],
)
def test_the_template_chooses_the_format(name, fmt):
    assert tool_calls.call_format(template(name), "auto") == fmt


def test_the_setting_overrides_the_template():
    llama = template("meta-llama-Llama-3.1-8B-Instruct.jinja")
    assert tool_calls.call_format(llama, "hermes") == tool_calls.HERMES
    assert tool_calls.call_format(None, LLAMA3) == LLAMA3


def arguments(call: dict) -> dict:
    return json.loads(call["function"]["arguments"])


@pytest.mark.parametrize(
    "text",
    [WEATHER, "  " + WEATHER + "\n", "<|python_tag|>" + WEATHER, WEATHER.replace("parameters", "arguments")],
)
def test_a_llama3_answer_that_is_a_json_call_is_a_call(text):
    content, calls = tool_calls.parse_calls(text, TOOLS, fmt=LLAMA3)
    assert content is None and len(calls) == 1
    assert calls[0]["function"]["name"] == "get_weather" and arguments(calls[0]) == {"city": "Paris"}
    assert calls[0]["id"].startswith("call_") and calls[0]["type"] == "function"


def test_llama3_calls_separated_by_semicolons_are_all_read():
    text = WEATHER + '; {"name": "add", "parameters": {"a": 1}};'
    content, calls = tool_calls.parse_calls(text, TOOLS, fmt=LLAMA3)
    assert content is None and [c["function"]["name"] for c in calls] == ["get_weather", "add"]
    assert arguments(calls[1]) == {"a": 1}
    _, first = tool_calls.parse_calls(text, TOOLS, parallel=False, fmt=LLAMA3)
    assert [c["function"]["name"] for c in first] == ["get_weather"]


@pytest.mark.parametrize(
    "text",
    [
        "The weather is fine.",
        WEATHER + " and then some text",  # not the whole answer
        'Sure: {"name": "get_weather", "parameters": {}}',
        '{"name": "unknown", "parameters": {}}',  # not an offered function
        '{"name": "get_weather", "parameters": [1]}',  # arguments not an object
        WEATHER + "; not json",
        "<tool_call>\n" + WEATHER + "\n</tool_call>",  # Hermes tags are no Llama 3 call
    ],
)
def test_other_llama3_answers_are_text(text):
    assert tool_calls.parse_calls(text, TOOLS, fmt=LLAMA3) == (text, [])


@pytest.mark.parametrize("cut", [1, 3, 7, 1000])
def test_a_streamed_llama3_answer_shows_text_and_holds_calls(cut):
    for text, expected_calls in [
        ("Paris is sunny. {not a call}", 0),
        ("  " + WEATHER, 1),
        ("<|python_tag|>" + WEATHER, 1),
    ]:
        watcher = tool_calls.CallWatcher(TOOLS, parallel=True, fmt=LLAMA3)
        shown = "".join(watcher.feed(text[i : i + cut]) for i in range(0, len(text), cut))
        rest, calls = watcher.finish()
        assert len(calls) == expected_calls
        if calls:
            assert shown + rest == "" and arguments(calls[0]) == {"city": "Paris"}
        else:
            assert shown + rest == text
            # text goes out as it comes, beyond the start, where it may still open a call
            assert cut == 1000 or len(shown) >= len(text) - cut


def test_hostile_llama3_answers_are_read_in_linear_time():
    with deadline(10):
        for text in [
            "[" * 200_000,
            "{" * 200_000,
            '{"name": "add", "parameters": ' + "[" * 3000 + "]" * 3000 + "}",
            (WEATHER + ";") * 20_000 + " trailing text",
            "{" + " " * 200_000,
        ]:
            assert tool_calls.parse_calls(text, TOOLS, fmt=LLAMA3) == (text, [])
            watcher = tool_calls.CallWatcher(TOOLS, parallel=True, fmt=LLAMA3)
            shown = "".join(watcher.feed(text[i : i + 5]) for i in range(0, len(text), 5))
            assert shown + watcher.finish()[0] == text


def request(**body) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate(
        {"model": "m", "tools": [t.model_dump() for t in TOOLS], **body}
    )


def accepts(spec, tokenizer, text: str) -> bool:
    """Whether llguidance's matcher of the grammar, as the server builds it, takes the whole text."""
    llg = llguidance.LLTokenizer(tokenizer.tokenizer.to_str(), n_vocab=tokenizer.vocab_size)
    matcher = llguidance.LLMatcher(llg, _grammar_text(spec), log_level=0)
    return matcher.consume_tokens(tokenizer.encode(text, add_special_tokens=False)) and matcher.is_accepting()


def test_the_llama3_grammar_is_one_bare_json_call_with_parameters(tiny_llama_dir):
    tokenizer = load_tokenizer(tiny_llama_dir)
    req = request(
        messages=[{"role": "user", "content": "Add."}],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )
    llama, hermes = tool_calls.call_grammar(req, LLAMA3), tool_calls.call_grammar(req)
    assert llama is not None and hermes is not None
    assert accepts(llama, tokenizer, WEATHER)
    assert not accepts(llama, tokenizer, "<tool_call>\n" + WEATHER + "\n</tool_call>")
    assert not accepts(llama, tokenizer, WEATHER.replace("parameters", "arguments"))
    hermes_call = '<tool_call>\n{"name": "get_weather", "arguments": {}}\n</tool_call>'
    assert accepts(hermes, tokenizer, hermes_call)


def test_a_history_call_reaches_llama_31s_template_as_an_object():
    """Llama 3.1's template writes `arguments | tojson`: a JSON string would come out quoted."""
    call = {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1}'}}
    req = request(
        messages=[
            {"role": "user", "content": "Add."},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "c1", "content": "3"},
        ]
    )
    messages = tool_calls.template_messages(req, template_takes_tools=True)
    llama = ChatTemplate(template("meta-llama-Llama-3.1-8B-Instruct.jinja"))
    text = llama.render(messages, bos_token="", eos_token="", tools=tool_calls.template_tools(req))
    assert '{"name": "add", "parameters": {"a": 1}}' in text
