"""Qwen3.5's and Qwen3-Coder's tool calls read from an answer (server/tool_calls.py's `qwen3_xml`
format, as vLLM's qwen3coder_tool_parser reads them):

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    <parameter=days>
    3
    </parameter>
    </function>
    </tool_call>

Each parameter's value is text, converted by the offered function's JSON Schema type of that
parameter: integer and number by int/float, boolean from true/false, object, array and null as
JSON; anything else (and a value that fails its conversion) is the text with one leading and one
trailing newline taken off. Read with str.find from left to right: linear in the answer.
"""

from __future__ import annotations

import math

from server.request_body import json_value

FUNCTION, FUNCTION_END = "<function=", "</function>"
PARAMETER, PARAMETER_END = "<parameter=", "</parameter>"
MAX_NAME = 256  # characters of a function's or a parameter's name


def read(inside: str, schemas: dict[str, dict]) -> dict | None:
    """The call {"name": ..., "arguments": {...}} written between <tool_call> and </tool_call>
    (`inside`, without its outer whitespace), or None: malformed, or of a function not offered
    (`schemas`: each offered function's parameters schema)."""
    if not inside.startswith(FUNCTION):
        return None
    close = inside.find(">", len(FUNCTION), len(FUNCTION) + MAX_NAME + 1)
    if close < 0:
        return None
    name = inside[len(FUNCTION) : close].strip()
    if name not in schemas or not inside.endswith(FUNCTION_END):
        return None
    body, at = inside[: -len(FUNCTION_END)], close + 1
    properties = schemas[name].get("properties") if isinstance(schemas[name], dict) else None
    properties = properties if isinstance(properties, dict) else {}
    arguments: dict = {}
    while True:
        at = _skip_space(body, at)
        if at == len(body):
            return {"name": name, "arguments": arguments}
        if not body.startswith(PARAMETER, at):
            return None
        at += len(PARAMETER)
        close = body.find(">", at, at + MAX_NAME + 1)
        end = body.find(PARAMETER_END, close + 1) if close >= 0 else -1
        if end < 0:
            return None
        key = body[at:close].strip()
        arguments[key] = convert(body[close + 1 : end], properties.get(key))
        at = end + len(PARAMETER_END)


def convert(text: str, schema) -> object:
    """A parameter's text as the value its schema's type asks for (the text where it is none)."""
    text = text.removeprefix("\n").removesuffix("\n")
    types = schema.get("type") if isinstance(schema, dict) else None
    types = [types] if isinstance(types, str) else types if isinstance(types, list) else []
    value = text.strip()
    if "null" in types and value == "null":
        return None
    for kind in types:
        if kind == "string":
            return text
        converted = _typed(value, kind)
        if converted is not None:
            return converted
    return text


def _typed(value: str, kind: object) -> object:
    """`value` as a JSON Schema `kind` other than string and null, or None where it is not one."""
    if kind == "integer":
        return _number(value, int)
    if kind == "number":
        number = _number(value, float)
        if not isinstance(number, float) or not math.isfinite(number):
            return None
        whole = _number(value, int)  # 3 stays an integer
        return number if whole is None else whole
    if kind == "boolean" and value.lower() in ("true", "false"):
        return value.lower() == "true"
    if kind in ("object", "array"):
        try:
            parsed = json_value(value)
        except ValueError:  # not JSON, or nested too deep
            return None
        return parsed if isinstance(parsed, dict if kind == "object" else list) else None
    return None


def _number(value: str, kind: type[int] | type[float]) -> int | float | None:
    try:
        return kind(value)
    except ValueError:  # not a number (or an integer past Python's 4300 digits)
        return None


def _skip_space(text: str, at: int) -> int:
    while at < len(text) and text[at].isspace():
        at += 1
    return at
