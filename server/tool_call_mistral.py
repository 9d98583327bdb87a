"""Mistral's tool calls read from an answer (server/tool_calls.py's `mistral` format), in both of
its shapes (as vLLM's mistral_tool_parser reads them):

    text before the calls[TOOL_CALLS][{"name": "f", "arguments": {...}}, ...]     tokenizers < v11
    text before the calls[TOOL_CALLS]f[ARGS]{...}[TOOL_CALLS]g[ARGS]{...}         v11+ (Magistral ...)
    text before the calls[TOOL_CALLS]f[CALL_ID]a1b2c3d4e[ARGS]{...}              Small 3.2, Devstral

A whole answer that is the JSON array alone is calls too: `[TOOL_CALLS]` is a special token, which
a text decode without special tokens drops, and tool_choice's grammar writes the array alone.
Everything after the marker must be calls, else the answer is text. Read left to right with
str.find and one JSON decode per call: linear in the answer.
"""

from __future__ import annotations

import json

from server.request_body import MAX_JSON_DEPTH, json_value

MARKER, ARGS, CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"
MARKERS = (MARKER, ARGS, CALL_ID)  # control tokens in Mistral's vocabularies
MAX_NAME = 256  # characters of a v11 call's function name and call id


def read(text: str) -> tuple[str, list] | None:
    """(the text before the calls, each call as the JSON value {"name": ..., "arguments": ...})
    of an answer that calls functions, or None (no calls, or malformed ones)."""
    start = text.find(MARKER)
    if start < 0:
        at = _skip_space(text, 0)
        found = _array(text, at) if text.startswith("[", at) else None
        return ("", found) if found else None
    at = _skip_space(text, start + len(MARKER))
    calls = _array(text, at) if text.startswith(("[", "{"), at) else _named(text, start)
    return (text[:start], calls) if calls else None


def _array(text: str, at: int) -> list | None:
    """The pre-v11 calls: a JSON array of calls (or one call object) that ends the answer."""
    decoded = _decode(text, at)
    if decoded is None or _skip_space(text, decoded[1]) < len(text):
        return None
    value = decoded[0]
    return value if isinstance(value, list) else [value]


def _named(text: str, at: int) -> list | None:
    """The v11+ calls: MARKER name [CALL_ID id] ARGS arguments, repeated to the answer's end (`at`:
    a MARKER); a call's id is kept as "id"."""
    calls = []
    while at < len(text):
        if not text.startswith(MARKER, at):
            return None
        at += len(MARKER)
        args = text.find(ARGS, at, at + MAX_NAME + len(ARGS))
        if args < 0:
            return None
        decoded = _decode(text, args + len(ARGS))
        if decoded is None:
            return None
        name, _, call_id = text[at:args].partition(CALL_ID)
        call = {"name": name.strip(), "arguments": decoded[0]}
        calls.append(call | {"id": call_id.strip()} if call_id else call)
        at = _skip_space(text, decoded[1])
    return calls


def _decode(text: str, at: int) -> tuple[object, int] | None:
    """(the JSON value at `at`, where it ends), or None: not JSON, or nested deeper than every JSON
    the server reads."""
    try:
        value, end = json.JSONDecoder().raw_decode(text, _skip_space(text, at))
    except (ValueError, RecursionError):
        return None
    part = text[at:end]
    if part.count("[") + part.count("{") > MAX_JSON_DEPTH:
        try:
            json_value(part)  # the server's depth bound
        except ValueError:
            return None
    return value, end


def _skip_space(text: str, at: int) -> int:
    while at < len(text) and text[at].isspace():
        at += 1
    return at
