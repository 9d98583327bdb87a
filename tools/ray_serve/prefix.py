"""Prompt prefixes for routing: the text a request's prompt starts with, hashed block by block, and
the routers of this process (the proxy's), by deployment name.

Ray Serve ships a request router's module to the caller by value (a copy of its globals), so what the
proxy shares with its router lives here, in a module both import by reference.
"""

from __future__ import annotations

import hashlib
import json
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tools.ray_serve.routing import PrefixAffinityRouter

ROUTERS: dict[str, PrefixAffinityRouter] = {}


def prompt_text(path: str, body: bytes) -> str:
    """The text a request's prompt starts with: the native `inputs`, OpenAI's `prompt`, or the
    contents of its chat `messages` in order; "" when the body has none (or is not JSON)."""
    try:
        request = json.loads(body) if body else None
    except (ValueError, UnicodeDecodeError):
        return ""
    if not isinstance(request, dict):
        return ""
    if path.startswith("/models/"):
        inputs = request.get("inputs")
        return inputs if isinstance(inputs, str) else ""
    prompt = request.get("prompt")
    if isinstance(prompt, list) and prompt:
        prompt = prompt[0]
    if isinstance(prompt, str):
        return prompt
    messages = request.get("messages")
    if isinstance(messages, list):
        parts = []
        for message in messages:
            if not isinstance(message, dict):  # the replica refuses it; the proxy only routes
                continue
            content = message.get("content")
            if isinstance(content, list):  # OpenAI's content parts
                texts = (p.get("text") for p in content if isinstance(p, dict))
                content = "".join(t for t in texts if isinstance(t, str))
            parts.append(f"{message.get('role', '')}:{content if isinstance(content, str) else ''}")
        return "\n".join(parts)
    return ""


def prefix_hashes(text: str, block_chars: int, blocks: int) -> list[str]:
    """One hash per full block of the first `blocks`, each over the whole prefix up to its end."""
    hashes, chain = [], hashlib.blake2b(digest_size=12)
    for start in range(0, min(len(text) // block_chars, blocks) * block_chars, block_chars):
        chain.update(text[start : start + block_chars].encode("utf-8", "surrogatepass"))
        hashes.append(chain.copy().hexdigest())
    return hashes
