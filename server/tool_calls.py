"""Tool calling on /v1/chat/completions.

The tools reach the model through its chat template when the template takes `tools` (Qwen, Hermes,
Llama 3.1 ...); otherwise (the default model's template does not) through a system message that
asks for this format, Hermes's:

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

Answers are read in the model's own format (`call_format`: model.tool_call_parser, auto from the
chat template): `hermes` (Qwen, Hermes: the tags above; a whole answer that is one JSON call is one
too), `llama3_json` (Llama 3.1-3.3: the whole answer is JSON calls, `{"name": ..., "parameters":
{...}}`, separated by `;`, after an optional `<|python_tag|>`), `mistral` (text, then
`[TOOL_CALLS]` and the calls: server/tool_call_mistral.py) or `qwen3_xml` (Qwen3.5, Qwen3-Coder:
`<tool_call>` around `<function=NAME>` and a `<parameter=P>` block per argument:
server/tool_call_qwen_xml.py).

`tool_choice` "required" or a named function constrains the answer to one such call by a grammar
(the arguments follow the function's JSON Schema); "auto" answers are parsed for calls; "none"
leaves the tools out.
Assistant messages with `tool_calls` and `role: "tool"` messages in the history are written in the
same format for templates that do not know them.
"""

from __future__ import annotations

import json
import re
import secrets
import string
import uuid
from collections.abc import Callable, Iterator

from agent.model.tokenizer import TextTokenizer
from server import tool_call_mistral, tool_call_qwen_xml
from server.errors import ApiError
from server.openai_schema import ChatCompletionRequest, ChatMessage, Tool
from server.request_body import MAX_JSON_DEPTH, TooDeep, json_value
from server.structured_output import JSON_OPTIONS, GrammarSpec

OPEN, CLOSE = "<tool_call>", "</tool_call>"
MISTRAL_ID = re.compile(r"[A-Za-z0-9]{9}")  # the ids Mistral's templates take
PYTHON_TAG = "<|python_tag|>"  # Llama 3.1's: a call (or code) follows
HERMES, LLAMA3_JSON, MISTRAL, QWEN3_XML = "hermes", "llama3_json", "mistral", "qwen3_xml"
SYSTEM_PROMPT = (
    "You can call functions. To call one, answer with exactly:\n"
    f'{OPEN}\n{{"name": <function name>, "arguments": <arguments as a JSON object>}}\n{CLOSE}\n'
    "Functions:\n"
)


def call_format(template: str | None, setting: str) -> str:
    """The format answers are read in: model.tool_call_parser, or (auto) the one the template
    teaches: Mistral's where it writes [TOOL_CALLS], Qwen3.5's XML where it writes `<function=` and
    `<parameter=` (within Hermes's tags, so before them), Hermes tags where it writes them, Llama 3's
    JSON where it asks for "parameters"."""
    if setting != "auto":
        return setting
    text = template or ""
    if tool_call_mistral.MARKER in text:
        return MISTRAL
    if tool_call_qwen_xml.FUNCTION in text and tool_call_qwen_xml.PARAMETER in text:
        return QWEN3_XML
    if OPEN not in text and (PYTHON_TAG in text or '"parameters"' in text):
        return LLAMA3_JSON
    return HERMES


def shown_markers(tokenizer: TextTokenizer, fmt: str) -> frozenset[int]:
    """The format's markers that the vocabulary holds as special tokens, which a decode drops:
    Mistral's [TOOL_CALLS], [ARGS] and [CALL_ID] (control tokens in its vocabularies). The answer's
    text keeps them, for its calls to be read (vLLM keeps Mistral's special tokens alike)."""
    if fmt != MISTRAL:
        return frozenset()
    return tokenizer.special_ids(tool_call_mistral.MARKERS)


def offered(req: ChatCompletionRequest) -> bool:
    """The model is told of the request's tools and its answer read for calls."""
    return bool(req.tools) and req.tool_choice != "none"


def template_messages(req: ChatCompletionRequest, template_takes_tools: bool) -> list[dict]:
    """The messages as the chat template renders them; for a template without tools, the tools
    as a system message and the history's calls and results as text in the format above."""
    messages = [_message(m, template_takes_tools) for m in req.messages]
    if offered(req) and not template_takes_tools:
        described = "\n".join(json.dumps(t.function.model_dump(exclude_none=True)) for t in req.tools or [])
        prompt = SYSTEM_PROMPT + described
        if messages and messages[0]["role"] == "system":
            messages[0] = {**messages[0], "content": prompt + "\n\n" + messages[0]["content"]}
        else:
            messages.insert(0, {"role": "system", "content": prompt})
    return messages


def template_tools(req: ChatCompletionRequest) -> list[dict] | None:
    """The tools as a template that takes them expects (OpenAI's shape), or None."""
    return [t.model_dump(exclude_none=True) for t in req.tools or []] if offered(req) else None


def _message(message: ChatMessage, template_takes_tools: bool) -> dict:
    text = message.text()
    thought = (message.model_extra or {}).get("reasoning_content")
    if template_takes_tools:
        out: dict = {"role": message.role, "content": text}
        if message.role == "assistant" and isinstance(thought, str):
            # an earlier answer's thinking as the client sends it back (vLLM's field): Qwen3's
            # template shows it within a turn of tool calls
            out["reasoning_content"] = thought
        if message.tool_calls:
            out["tool_calls"] = [
                {
                    "type": "function",
                    "id": c.id,
                    # as an object: Llama 3's template writes `arguments | tojson`
                    "function": {"name": c.function.name, "arguments": _arguments(c.function.arguments)},
                }
                for c in message.tool_calls
            ]
        if message.tool_call_id:
            out["tool_call_id"] = message.tool_call_id
        return out
    if message.role == "tool":
        return {"role": "tool", "content": f"<tool_response>\n{text}\n</tool_response>"}
    calls = [
        f"{OPEN}\n"
        + json.dumps({"name": c.function.name, "arguments": _arguments(c.function.arguments)})
        + f"\n{CLOSE}"
        for c in message.tool_calls or []
    ]
    return {"role": message.role, "content": "\n".join([text, *calls] if text else calls)}


def call_grammar(req: ChatCompletionRequest, fmt: str = HERMES) -> GrammarSpec | None:
    """For tool_choice "required" or a named function: one call of an offered function whose
    arguments follow its schema (a Lark grammar with llguidance's inline JSON Schema), in the
    model's format."""
    if not req.tools or req.tool_choice in (None, "auto", "none"):
        return None
    named = None if isinstance(req.tool_choice, str) else req.tool_choice.function.name
    if fmt == QWEN3_XML:
        return _qwen_xml_grammar([t for t in req.tools if named is None or t.function.name == named])
    arguments = "parameters" if fmt == LLAMA3_JSON else "arguments"
    calls = [
        {
            "type": "object",
            "properties": {"name": {"const": t.function.name}, arguments: t.function.parameters},
            "required": ["name", arguments],
            "additionalProperties": False,
        }
        for t in req.tools
        if named is None or t.function.name == named
    ]
    schema = {"x-guidance": dict(JSON_OPTIONS), "anyOf": calls}
    if fmt == LLAMA3_JSON:
        return GrammarSpec("lark", f"start: call\ncall: %json {json.dumps(schema)}")
    if fmt == MISTRAL:  # the array alone: the marker is a special token, which text cannot force
        return GrammarSpec("lark", f'start: "[" call "]"\ncall: %json {json.dumps(schema)}')
    start = f"start: {json.dumps(OPEN + chr(10))} call {json.dumps(chr(10) + CLOSE)}"
    return GrammarSpec("lark", f"{start}\ncall: %json {json.dumps(schema)}")


# A string parameter's value and its end: text up to the first </parameter>, as the reader takes it
# (one lexeme: a value lexeme then the end tag would stop short of the tag's last character).
QWEN_TEXT = r"/(.|\n)*\n<\/parameter>\n/ & ~/(.|\n)*<\/parameter>(.|\n)*<\/parameter>(.|\n)*/"


def _qwen_xml_grammar(tools: list[Tool]) -> GrammarSpec:
    """One Qwen3.5 XML call of one of `tools`, with its function's required parameters in their
    order: a string's value as text (without </parameter>), any other's as JSON of its schema."""
    rules, calls = [], []
    for i, tool in enumerate(tools):
        schema: dict = tool.function.parameters if isinstance(tool.function.parameters, dict) else {}
        given = schema.get("properties")
        properties: dict = given if isinstance(given, dict) else {}
        required = [p for p in schema.get("required") or [] if isinstance(p, str)]
        parts = [json.dumps(f"{tool.function.name}>\n")]
        for j, name in enumerate(required):
            prop = properties.get(name)
            prop = prop if isinstance(prop, dict) else {}
            kind = prop.get("type")
            kinds = [kind] if isinstance(kind, str) else kind if isinstance(kind, list) else []
            opened = json.dumps(f"{tool_call_qwen_xml.PARAMETER}{name}>\n")
            closed = json.dumps(f"\n{tool_call_qwen_xml.PARAMETER_END}\n")
            if not kinds or "string" in kinds:  # read as text
                rules.append(f"p{i}_{j}: {opened} QWEN_TEXT")
            else:
                json_schema = {"x-guidance": dict(JSON_OPTIONS), **prop}
                rules.append(f"p{i}_{j}: {opened} v{i}_{j} {closed}")
                rules.append(f"v{i}_{j}: %json {json.dumps(json_schema)}")
            parts.append(f"p{i}_{j}")
        rules.append(f"c{i}: " + " ".join(parts))
        calls.append(f"c{i}")
    begin = json.dumps(f"{OPEN}\n{tool_call_qwen_xml.FUNCTION}")
    end = json.dumps(f"{tool_call_qwen_xml.FUNCTION_END}\n{CLOSE}")
    lines = [f"start: {begin} call {end}", "call: " + " | ".join(calls), *rules, f"QWEN_TEXT: {QWEN_TEXT}"]
    return GrammarSpec("lark", "\n".join(lines))


def parse_calls(
    text: str, tools: list[Tool], parallel: bool = True, fmt: str = HERMES
) -> tuple[str | None, list[dict]]:
    """(the answer's text outside calls or None, its calls in OpenAI's shape). Calls of functions
    that were not offered, or whose arguments are not a JSON object, stay text."""
    names = {t.function.name for t in tools}
    if fmt == LLAMA3_JSON:
        found = _json_calls(text, names)
        if not found:
            return text, []
        return None, found if parallel else found[:1]
    if fmt == MISTRAL:
        return _mistral_calls(text, names, parallel)
    schemas = {t.function.name: t.function.parameters or {} for t in tools}
    calls, kept, end = [], [], 0
    for start, stop, inside in _blocks(text):
        if fmt == QWEN3_XML:
            read = tool_call_qwen_xml.read(inside, schemas)
            call = None if read is None else _value_call(read, names)
        else:
            call = _call(inside, names)
        if call is not None:
            kept.append(text[end:start])
            end = stop
            calls.append(call)
    kept.append(text[end:])
    if not calls and fmt != QWEN3_XML:
        whole = _call(text.strip(), names)  # Llama 3 style: the answer is one JSON call
        if whole is not None:
            return None, [whole]
    content = "".join(kept).strip()
    return content or None, calls if parallel else calls[:1]


def _mistral_calls(text: str, names: set[str], parallel: bool) -> tuple[str | None, list[dict]]:
    """Mistral's calls (tool_call_mistral.read), all of offered functions with object arguments,
    or none: the answer is text."""
    read = tool_call_mistral.read(text)
    taken: set[str] = set()
    shaped = [_mistral_call(value, names, taken) for value in read[1]] if read else []
    calls = [call for call in shaped if call is not None]
    if read is None or len(calls) < len(shaped):
        return text, []
    return read[0].strip() or None, calls if parallel else calls[:1]


def _blocks(text: str) -> Iterator[tuple[int, int, str]]:
    """(start, end, what is inside without its outer whitespace) of each OPEN ... CLOSE, the first
    CLOSE after each OPEN ending it. Found by str.find from where the last one ended: linear, where
    a pattern backtracks in cubic time over an OPEN that is never closed."""
    at = 0
    while (start := text.find(OPEN, at)) >= 0:
        close = text.find(CLOSE, start + len(OPEN))
        if close < 0:
            return
        at = close + len(CLOSE)
        yield start, at, text[start + len(OPEN) : close].strip()


def _arguments(text: str):
    """A history call's arguments as JSON (as sent, when they are not JSON: the model sees them)."""
    try:
        return json_value(text)
    except TooDeep as exc:
        raise ApiError(400, f"a tool call's arguments: {exc}") from None
    except ValueError:
        return text


def _json_calls(text: str, names: set[str]) -> list[dict] | None:
    """Llama 3's calls: the whole answer (after an optional PYTHON_TAG) JSON calls separated by
    `;`, or None. One pass of the JSON decoder over the text: linear."""
    text = text.strip()
    text = text.removeprefix(PYTHON_TAG).lstrip()
    decoder, calls, at = json.JSONDecoder(), [], 0
    while True:
        try:
            value, end = decoder.raw_decode(text, at)
        except (ValueError, RecursionError):
            return None
        part = text[at:end]
        if part.count("[") + part.count("{") > MAX_JSON_DEPTH:
            try:
                json_value(part)  # the same depth bound as every JSON the server reads
            except ValueError:
                return None
        call = _value_call(value, names)
        if call is None:
            return None
        calls.append(call)
        at = _skip_space(text, end)
        if at < len(text) and text[at] == ";":
            at = _skip_space(text, at + 1)
        elif at < len(text):
            return None
        if at == len(text):
            return calls


def _skip_space(text: str, at: int) -> int:
    while at < len(text) and text[at].isspace():
        at += 1
    return at


def _call(text: str, names: set[str]) -> dict | None:
    try:
        value = json_value(text)
    except ValueError:  # not JSON, or nested too deep: the answer's text
        return None
    return _value_call(value, names)


def _openai_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def _mistral_id() -> str:
    """Mistral's templates refuse a history call whose id is not 9 letters and digits (vLLM's
    MistralToolCall ids are made alike)."""
    return "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(9))


def _mistral_call(value, names: set[str], taken: set[str]) -> dict | None:
    """A Mistral call in OpenAI's shape, with the id the model wrote when it is one Mistral's
    templates take (`[CALL_ID]`, or "id" in a JSON call) and no earlier call of the answer has it
    (`taken`: their ids), else a new one."""
    call = _value_call(value, names, _mistral_id)
    given = value.get("id") if isinstance(value, dict) else None
    if call is not None and isinstance(given, str) and MISTRAL_ID.fullmatch(given) and given not in taken:
        call["id"] = given
    if call is not None:
        taken.add(call["id"])
    return call


def _value_call(value, names: set[str], make_id: Callable[[], str] = _openai_id) -> dict | None:
    if not isinstance(value, dict) or value.get("name") not in names:
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    if not isinstance(arguments, dict):
        return None
    return {
        "id": make_id(),
        "type": "function",
        "function": {"name": value["name"], "arguments": json.dumps(arguments, ensure_ascii=False)},
    }


class CallWatcher:
    """A streamed answer's text with calls kept out: text goes out as it comes, except what could be
    the start of a call tag, and everything from a call tag on (parsed at the end)."""

    def __init__(self, tools: list[Tool], parallel: bool, fmt: str = HERMES):
        self.tools, self.parallel, self.fmt = tools, parallel, fmt
        self.pieces: list[str] = []  # the answer so far, joined once at the end
        self.unsent = ""  # held back while no call tag is seen: at most a partial tag
        self.sent = 0  # characters of text handed out
        self.holding = False  # a call tag was seen: the rest waits for the end

    def feed(self, piece: str) -> str:
        """The part of the answer so far that can go out now."""
        self.pieces.append(piece)
        if self.holding:
            return ""
        text = self.unsent + piece  # short: at most a partial tag was held back
        if self.fmt != QWEN3_XML and self.sent == 0 and text.lstrip().startswith(("{", PYTHON_TAG)):
            self.holding = True  # maybe one JSON call as the whole answer (Llama 3 style)
            return ""
        if self.fmt == MISTRAL and self.sent == 0 and len(text) < 64 and text.isspace():
            self.unsent = text  # the answer's start: what follows may be its calls
            return ""
        if self.fmt == MISTRAL and self.sent == 0 and text.lstrip().startswith("["):
            self.holding = True  # the marker, or calls as the whole answer (the array alone)
            return ""
        if self.fmt == LLAMA3_JSON:
            if self.sent == 0 and len(text) < 64 and PYTHON_TAG.startswith(text.lstrip()):
                self.unsent = text  # the answer's start: maybe the tag, or whitespace before "{"
                return ""
            self.unsent, self.sent = "", self.sent + len(text)
            return text
        tag = tool_call_mistral.MARKER if self.fmt == MISTRAL else OPEN
        start = text.find(tag)
        if start >= 0:
            self.holding, limit = True, start
        else:  # hold back what could be the beginning of the tag
            limit = len(text) - _partial_tag(text, tag)
        out, self.unsent = text[:limit], text[limit:]
        self.sent += limit
        return out

    def finish(self) -> tuple[str, list[dict]]:
        """(text not yet handed out, the calls of the whole answer)."""
        text = "".join(self.pieces)
        content, calls = parse_calls(text, self.tools, self.parallel, self.fmt)
        if not calls:
            rest, self.sent = text[self.sent :], len(text)
            return rest, []
        if self.sent == 0:  # nothing went out: the text outside the calls is the content
            return content or "", calls
        return "", calls  # the text before the first call already went out


def _partial_tag(text: str, tag: str = OPEN) -> int:
    """How many characters at the end of `text` could begin `tag`."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-size:]):
            return size
    return 0
