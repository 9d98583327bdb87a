"""The servers a benchmark drives, and how each one's stream is asked for and parsed.

A target is a URL; its path says the API:
    http://HOST:PORT/models/NAME            this project's native API (plain `data:` lines)
    http://HOST:PORT/v1/completions         OpenAI completions (SSE `data: {...}`, `data: [DONE]`)
    http://HOST:PORT/v1/chat/completions    OpenAI chat completions
`label=URL` names it in the report; otherwise the label is the host:port.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from urllib.parse import urlparse


class TargetError(ValueError):
    pass


@dataclass(frozen=True)
class Target:
    label: str
    url: str
    api: str  # "native", "completions" or "chat"
    extra: dict = field(default_factory=dict, compare=False)  # added to each timed request (--extra-body)
    headers: dict = field(default_factory=dict, compare=False)  # sent with each request (--api-key)

    def with_extra(self, extra: dict) -> Target:
        return replace(self, extra=extra)

    def with_key(self, key: str | None) -> Target:
        """The same target, its requests sending `key` as `Authorization: Bearer` (None: none)."""
        return replace(self, headers={"Authorization": f"Bearer {key}"} if key else {})

    @property
    def health_url(self) -> str:
        parsed = urlparse(self.url)
        return f"{parsed.scheme}://{parsed.netloc}/health"

    @property
    def metrics_url(self) -> str:
        parsed = urlparse(self.url)
        return f"{parsed.scheme}://{parsed.netloc}/metrics"

    @classmethod
    def parse(cls, spec: str) -> Target:
        label, _, url = spec.rpartition("=") if "=" in spec.split("://")[0] else ("", "", spec)
        parsed = urlparse(url)
        if parsed.scheme not in ("http", "https") or not parsed.netloc:
            raise TargetError(f"target {spec!r}: expected an http(s) URL")
        path = parsed.path.rstrip("/")
        if path.endswith("/v1/chat/completions"):
            api = "chat"
        elif path.endswith("/v1/completions"):
            api = "completions"
        elif "/models/" in path and not path.endswith("/models/"):
            api = "native"
            url = url.rstrip("/")
            for suffix in ("/generate_stream", "/generate"):
                url = url.removesuffix(suffix)
        else:
            raise TargetError(
                f"target {spec!r}: the path must be /models/NAME, /v1/completions or /v1/chat/completions"
            )
        return cls(label or parsed.netloc, url, api)

    def request_body(
        self,
        prompt: str,
        max_tokens: int,
        ignore_eos: bool,
        model: str | None,
        stop: list[str] | None = None,
        full_vocab: bool = False,
    ) -> dict:
        """A streaming request for `max_tokens` new tokens: greedy, or with `full_vocab` sampled at
        temperature 1 from the whole vocabulary (no top-k, no top-p); `stop`: its stop strings."""
        if self.api == "native":
            parameters: dict = {
                "max_new_tokens": max_tokens,
                "return_protocol": "plain",
                "ignore_eos": ignore_eos,
            }
            if stop:
                parameters["stop"] = stop
            if full_vocab:  # the native API's top_k defaults to 3: 0 turns it off
                parameters.update(do_sample=True, temperature=1.0, top_k=0, top_p=1.0)
            return {"inputs": prompt, "stream": True, "parameters": parameters | self.extra}
        body = {
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "stream": True,
            "stream_options": {"include_usage": True},
            "ignore_eos": ignore_eos,
        }
        if stop:
            body["stop"] = stop
        if full_vocab:  # top_k: the vLLM / llama.cpp extension, 0 = off
            body.update(temperature=1.0, top_p=1.0, top_k=0)
        if model:
            body["model"] = model
        if self.api == "chat":
            body["messages"] = [{"role": "user", "content": prompt}]
        else:
            body["prompt"] = prompt
        return body | self.extra


@dataclass
class StreamEvent:
    text: str = ""  # new output text (may be empty)
    token: bool = False  # it carries a generated token, even one with no text of its own
    tokens: int | None = None  # the server's own count of output tokens, when it reports one
    # speculative decoding: tokens drafted and accepted, where the server reports them per request
    # (llama.cpp's `timings`)
    drafted: int | None = None
    accepted: int | None = None
    error: str | None = None
    done: bool = False


def parse_line(api: str, line: str) -> StreamEvent | None:
    """One line of a streamed response; None for lines that carry nothing (blank, comments)."""
    line = line.strip()
    if not line.startswith("data:"):
        return None
    payload = line[len("data:") :].strip()
    if payload == "[DONE]":
        return StreamEvent(done=True)
    data = json.loads(payload)
    if api == "native":
        if "error" in data:
            return StreamEvent(error=str(data["error"]))
        if "generated_text" in data:
            return StreamEvent(done=True)
        return StreamEvent(text=data["token"]["text"], token=True)  # the plain protocol: a line a token
    if "error" in data:
        error = data["error"]
        return StreamEvent(error=str(error.get("message", error) if isinstance(error, dict) else error))
    event = StreamEvent()
    if data.get("usage"):
        event.tokens = data["usage"].get("completion_tokens")
    timings = data.get("timings") or {}
    if "draft_n" in timings:
        event.drafted, event.accepted = timings["draft_n"], timings.get("draft_n_accepted", 0)
    for choice in data.get("choices") or []:
        delta = choice if api == "completions" else (choice.get("delta") or {})
        piece = delta.get("text" if api == "completions" else "content")
        event.text += piece or ""
        # vLLM sends a chunk per token, its text empty while a character is incomplete; a chat's
        # first chunk (the role) and a last one that only says why the answer ended carry none.
        event.token |= bool(piece) or (
            isinstance(piece, str) and "role" not in delta and choice.get("finish_reason") is None
        )
    return event
