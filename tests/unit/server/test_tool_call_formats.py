"""Each family's tool call format (server/tool_calls.py): which one a real chat template teaches
(tests/unit/agent/chat_templates/), Llama 3's JSON calls read from whole answers and streams, its
grammar for tool_choice required, and a history's calls written back through Llama 3.1's template;
Mistral's calls in both its shapes, likewise; hostile answers read in linear time."""

import json
from pathlib import Path

import llguidance
import pytest
from transformers.utils.chat_template_utils import render_jinja_template

from agent.model.chat_template import ChatTemplate
from agent.model.detokenizer import IncrementalDetokenizer
from agent.model.tokenizer import load_tokenizer
from server import tool_calls
from server.openai_schema import ChatCompletionRequest, Tool
from server.structured_output import _grammar_text
from time_limit import deadline
from tiny_models import write_tokenizer

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


# Mistral: text, then `[TOOL_CALLS]` and a JSON array of calls (tokenizers before v11), or
# `[TOOL_CALLS]name[ARGS]{...}` repeated (v11+: Mistral Small 3.2, Magistral, Devstral).
MISTRAL = tool_calls.MISTRAL
MARKER = "[TOOL_CALLS]"
# Mistral-7B-Instruct-v0.3's chat template, written from memory and shortened (no system message,
# no history calls): what matters here is that it writes [AVAILABLE_TOOLS] and [TOOL_CALLS].
MISTRAL_NEMO = "mistralai-Mistral-Nemo-Instruct-2407.jinja"
PARIS = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
ADD = '{"name": "add", "arguments": {"a": 1}}'


def names(calls: list[dict]) -> list[str]:
    return [c["function"]["name"] for c in calls]


def test_a_template_that_writes_tool_calls_markers_is_mistrals():
    assert tool_calls.call_format(template(MISTRAL_NEMO), "auto") == MISTRAL
    assert tool_calls.call_format(template(MISTRAL_NEMO), "hermes") == tool_calls.HERMES
    assert tool_calls.call_format(None, MISTRAL) == MISTRAL


@pytest.mark.parametrize(
    ("text", "content"),
    [
        (MARKER + "[" + PARIS + ", " + ADD + "]", None),  # before v11
        ("Let me look.\n" + MARKER + " [" + PARIS + ", " + ADD + "]\n", "Let me look."),
        (MARKER + 'get_weather[ARGS]{"city": "Paris"}' + MARKER + 'add[ARGS]{"a": 1}', None),  # v11+
        (
            "Checking. " + MARKER + 'get_weather[ARGS] {"city": "Paris"} ' + MARKER + 'add[ARGS]{"a": 1}',
            "Checking.",
        ),
        ("[" + PARIS + ", " + ADD + "]", None),  # the marker dropped as a special token, or the grammar's
    ],
)
def test_both_mistral_shapes_are_read(text, content):
    found, calls = tool_calls.parse_calls(text, TOOLS, fmt=MISTRAL)
    assert found == content and names(calls) == ["get_weather", "add"]
    assert arguments(calls[0]) == {"city": "Paris"} and arguments(calls[1]) == {"a": 1}
    assert all(len(c["id"]) == 9 and c["id"].isalnum() and c["type"] == "function" for c in calls)
    assert len({c["id"] for c in calls}) == 2
    _, first = tool_calls.parse_calls(text, TOOLS, parallel=False, fmt=MISTRAL)
    assert names(first) == ["get_weather"]


def test_mistral_call_ids_the_model_writes_are_kept_where_a_template_takes_them():
    """Mistral Small 3.2 and Devstral write `name[CALL_ID]id[ARGS]{...}`: a 9-character id of
    letters and digits is the call's id; another id, or one an earlier call has, gets a new one."""
    text = (
        "Checking. "
        + MARKER
        + 'get_weather[CALL_ID]a1B2c3D4e[ARGS]{"city": "Paris"}'
        + MARKER
        + 'add[CALL_ID]a1B2c3D4e[ARGS]{"a": 1}'  # the same id again
        + MARKER
        + 'add[CALL_ID]call_1[ARGS]{"a": 2}'  # not one Mistral's templates take
    )
    content, calls = tool_calls.parse_calls(text, TOOLS, fmt=MISTRAL)
    assert content == "Checking." and names(calls) == ["get_weather", "add", "add"]
    assert [arguments(c) for c in calls] == [{"city": "Paris"}, {"a": 1}, {"a": 2}]
    ids = [c["id"] for c in calls]
    assert ids[0] == "a1B2c3D4e" and len(set(ids)) == 3
    assert all(len(i) == 9 and i.isalnum() for i in ids)
    _, (json_call,) = tool_calls.parse_calls(
        MARKER + '[{"name": "add", "arguments": {"a": 1}, "id": "Zz9Yy8Xx7"}]', TOOLS, fmt=MISTRAL
    )
    assert json_call["id"] == "Zz9Yy8Xx7"
    # the calls go back through Mistral Small 3.2's template, which refuses any other id
    req = request(
        messages=[
            {"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": None, "tool_calls": calls},
            *({"role": "tool", "tool_call_id": i, "content": "ok"} for i in ids),
        ]
    )
    rendered = ChatTemplate(template("Mistral-Small-3.2-24B-Instruct-2506.jinja")).render(
        tool_calls.template_messages(req, template_takes_tools=True),
        bos_token="<s>",
        eos_token="</s>",
        tools=tool_calls.template_tools(req),
    )
    assert '[TOOL_CALLS]get_weather[CALL_ID]a1B2c3D4e[ARGS]{"city": "Paris"}' in rendered


def test_a_mistral_call_with_a_marker_inside_its_arguments_is_one_call():
    text = MARKER + 'add[ARGS]{"a": "[TOOL_CALLS]x[ARGS]{}"}'
    _, calls = tool_calls.parse_calls(text, TOOLS, fmt=MISTRAL)
    assert arguments(calls[0]) == {"a": "[TOOL_CALLS]x[ARGS]{}"} and len(calls) == 1


@pytest.mark.parametrize(
    "text",
    [
        "The weather is fine.",
        "[1, 2, 3]",
        "[" + PARIS + "] and some text after",
        "Sure: [" + PARIS + "]",  # an array after text, with no marker
        MARKER,
        MARKER + "[]",
        MARKER + "[" + PARIS,  # cut
        MARKER + "[" + PARIS + "] trailing",
        MARKER + '[{"name": "unknown", "arguments": {}}]',  # not an offered function
        MARKER + '[{"name": "add", "arguments": [1]}]',  # arguments not an object
        MARKER + "[" + PARIS + ', {"name": "unknown", "arguments": {}}]',  # one bad call: all text
        MARKER + 'get_weather{"city": "Paris"}',  # no [ARGS]
        MARKER + 'get_weather[ARGS]{"city": ',
        MARKER + "get_weather[ARGS]not json",
        MARKER + 'get_weather[ARGS]{"city": "Paris"} trailing',
        MARKER + "x" * 300 + '[ARGS]{"a": 1}',  # a name too long
        MARKER + 'unknown[ARGS]{"a": 1}',
        "<tool_call>\n" + PARIS + "\n</tool_call>",  # Hermes tags are no Mistral call
    ],
)
def test_other_mistral_answers_are_text(text):
    assert tool_calls.parse_calls(text, TOOLS, fmt=MISTRAL) == (text, [])


def streamed(text: str, cut: int, fmt: str = MISTRAL) -> tuple[str, str, list[dict]]:
    watcher = tool_calls.CallWatcher(TOOLS, parallel=True, fmt=fmt)
    shown = "".join(watcher.feed(text[i : i + cut]) for i in range(0, len(text), cut))
    rest, calls = watcher.finish()
    return shown, rest, calls


@pytest.mark.parametrize("cut", [1, 2, 5, 11, 1000])
def test_a_streamed_mistral_answer_shows_its_text_and_holds_its_calls(cut):
    before = "Let me check [the weather]. "
    for text in [
        before + MARKER + "[" + PARIS + "]",
        before + MARKER + 'get_weather[ARGS]{"city": "Paris"}',
        "  " + MARKER + "[" + PARIS + "]",
        "[" + PARIS + "]",
    ]:
        shown, rest, calls = streamed(text, cut)
        assert names(calls) == ["get_weather"] and arguments(calls[0]) == {"city": "Paris"}
        expected = before if text.startswith(before) else ""
        assert shown + rest == expected and MARKER[:2] not in shown + rest
    for text in ["Paris is sunny [1]. [TOOL_CALL", "Not a call: " + MARKER + "nothing", "[1] first"]:
        shown, rest, calls = streamed(text, cut)
        assert calls == [] and shown + rest == text


def test_a_streamed_mistral_answer_goes_out_as_it_comes():
    """Beyond its start, text waits only while it may be the beginning of the marker."""
    watcher = tool_calls.CallWatcher(TOOLS, parallel=True, fmt=MISTRAL)
    assert watcher.feed("Hello ") == "Hello "
    assert watcher.feed("there [TOOL") == "there "
    assert watcher.feed("S] of") == "[TOOLS] of"


def test_hostile_mistral_answers_are_read_in_linear_time():
    with deadline(10):
        for text in [
            MARKER * 50_000,
            "[" * 200_000,
            MARKER + "[" * 200_000,
            MARKER + "get_weather[ARGS]" + "{" * 200_000,
            MARKER + "get_weather[ARGS]" + " " * 200_000,
            (MARKER + 'add[ARGS]{"a": 1}') * 20_000 + " trailing text",
            MARKER + "[" + (ADD + ", ") * 20_000 + "]",
            "[" + MARKER[1:] * 50_000,
            "x" * 200_000 + MARKER[:-1],
            MARKER + '[{"name": "add", "arguments": ' + "[" * 3000 + "]" * 3000 + "}]",
        ]:
            assert tool_calls.parse_calls(text, TOOLS, fmt=MISTRAL) == (text, [])
            shown, rest, calls = streamed(text, 5)
            assert calls == [] and shown + rest == text


def test_the_mistral_grammar_is_a_json_array_of_one_call(tiny_llama_dir):
    tokenizer = load_tokenizer(tiny_llama_dir)
    named = request(
        messages=[{"role": "user", "content": "Weather?"}],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )
    spec = tool_calls.call_grammar(named, MISTRAL)
    assert spec is not None
    assert accepts(spec, tokenizer, "[" + PARIS + "]")
    assert not accepts(spec, tokenizer, PARIS)
    assert not accepts(spec, tokenizer, "[" + ADD + "]")  # not the named function
    assert not accepts(spec, tokenizer, "[" + PARIS + ", " + PARIS + "]")
    required = tool_calls.call_grammar(
        request(messages=[{"role": "user", "content": "Add."}], tool_choice="required"), MISTRAL
    )
    assert required is not None and accepts(required, tokenizer, "[" + ADD + "]")
    # what the grammar lets through is read as a call
    assert names(tool_calls.parse_calls("[" + PARIS + "]", TOOLS, fmt=MISTRAL)[1]) == ["get_weather"]


def test_a_history_call_reaches_mistrals_template_as_an_object():
    """Mistral Nemo's real template: arguments as an object, and the call's id as the model's own
    calls carry it (9 letters and digits: the template refuses others)."""
    [made] = tool_calls.parse_calls("[" + PARIS + "]", TOOLS, fmt=MISTRAL)[1]
    assert len(made["id"]) == 9 and made["id"].isalnum()
    call = {**made, "function": {"name": "add", "arguments": '{"a": 1}'}}
    req = request(
        messages=[
            {"role": "user", "content": "Add."},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": made["id"], "content": "3"},
        ]
    )
    messages = tool_calls.template_messages(req, template_takes_tools=True)
    text = ChatTemplate(template(MISTRAL_NEMO)).render(
        messages, bos_token="<s>", eos_token="</s>", tools=tool_calls.template_tools(req)
    )
    assert f'[TOOL_CALLS][{{"name": "add", "arguments": {{"a": 1}}, "id": "{made["id"]}"}}]</s>' in text
    assert f'[TOOL_RESULTS]{{"content": 3, "call_id": "{made["id"]}"}}[/TOOL_RESULTS]' in text
    assert "[INST]Add.[/INST]" in text


def test_mistrals_markers_stay_in_the_answers_text_where_they_are_special_tokens(tmp_path):
    """Mistral's vocabularies hold [TOOL_CALLS], [ARGS] and [CALL_ID] as control tokens, which a
    decode drops: the answer's text keeps them (shown_markers, the detokenizer's `shown`) and its
    call is read, with its id."""
    mistral, plain = tmp_path / "mistral", tmp_path / "plain"
    for directory in (mistral, plain):
        directory.mkdir()
    write_tokenizer(mistral, specials=("[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"))
    write_tokenizer(plain)
    tokenizer = load_tokenizer(mistral)
    shown = tool_calls.shown_markers(tokenizer, MISTRAL)
    markers = ("[TOOL_CALLS]", "[ARGS]", "[CALL_ID]")
    [marker], [args], [call_id] = (tokenizer.encode(m, add_special_tokens=False) for m in markers)
    assert shown == {marker, args, call_id}
    assert tool_calls.shown_markers(tokenizer, tool_calls.HERMES) == set()
    assert tool_calls.shown_markers(load_tokenizer(plain), MISTRAL) == set()  # plain text there
    text = tokenizer.encode
    ids = [*text("Checking. "), marker, *text("get_weather"), call_id, *text("a1B2c3D4e"), args]
    ids += text('{"city": "Paris"}')
    detokenizer = IncrementalDetokenizer(tokenizer, shown)
    answer = "".join(detokenizer.add(t) for t in ids) + detokenizer.flush()
    assert answer == 'Checking. [TOOL_CALLS]get_weather[CALL_ID]a1B2c3D4e[ARGS]{"city": "Paris"}'
    content, calls = tool_calls.parse_calls(answer, TOOLS, fmt=MISTRAL)
    assert content == "Checking." and names(calls) == ["get_weather"] and calls[0]["id"] == "a1B2c3D4e"
    plain_decode = tokenizer.decode(ids)
    assert plain_decode == 'Checking. get_weathera1B2c3D4e{"city": "Paris"}'  # what a plain decode leaves


def test_an_answers_reasoning_sent_back_reaches_the_template():
    """A client sends an earlier answer back with its reasoning_content (vLLM's field): Qwen3's
    template shows it in the turn of tool calls that follows the last question, as transformers
    renders the same messages."""
    call = {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1}'}}
    req = request(
        messages=[
            {"role": "user", "content": "Add."},
            {"role": "assistant", "content": "", "tool_calls": [call], "reasoning_content": "one and two"},
            {"role": "tool", "tool_call_id": "call_1", "content": "3"},
        ]
    )
    messages = tool_calls.template_messages(req, template_takes_tools=True)
    assert messages[1]["reasoning_content"] == "one and two" and "reasoning_content" not in messages[0]
    text, tools = template("Qwen-Qwen3-0.6B.jinja"), tool_calls.template_tools(req)
    ours = ChatTemplate(text).render(messages, bos_token="", eos_token="", tools=tools)
    [reference], _ = render_jinja_template(
        [messages], tools=tools, chat_template=text, add_generation_prompt=True
    )
    assert ours == reference and "<think>\none and two\n</think>" in ours
