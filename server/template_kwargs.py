"""vLLM's `chat_template_kwargs`: more variables for the model's chat template (Qwen3's
`enable_thinking`, ...), on /v1/chat/completions, /v1/responses and /v1/messages. An object, of
bounded size and nesting (the template may walk it), that may not replace what the server sets
itself (the messages, the tools, the special tokens: agent/model/chat_template.py's RESERVED)."""

from __future__ import annotations

import json

from agent.model.chat_template import RESERVED

MAX_TEMPLATE_KWARGS_BYTES = 16384  # as JSON
MAX_TEMPLATE_KWARGS_DEPTH = 8  # containers inside the object


def check_template_kwargs(value: dict | None) -> dict | None:
    """The kwargs, or a ValueError saying what is wrong with them (a 400 naming the field)."""
    if value is None:
        return None
    reserved = sorted(RESERVED & set(value))
    if reserved:
        raise ValueError(f"may not set {', '.join(reserved)} (the server sets them)")
    level: list = list(value.values())
    for _ in range(MAX_TEMPLATE_KWARGS_DEPTH):  # level by level: no recursion on hostile nesting
        level = [
            child
            for v in level
            if isinstance(v, (dict, list))
            for child in (v.values() if isinstance(v, dict) else v)
        ]
    if any(isinstance(v, (dict, list)) for v in level):
        raise ValueError(f"nests deeper than {MAX_TEMPLATE_KWARGS_DEPTH} levels")
    size = len(json.dumps(value, ensure_ascii=False).encode("utf-8", "surrogatepass"))
    if size > MAX_TEMPLATE_KWARGS_BYTES:
        raise ValueError(f"takes {size} bytes as JSON; at most {MAX_TEMPLATE_KWARGS_BYTES} are accepted")
    return value
