"""Talking to an OpenAI-compatible server for `python -m tools.quality`: its tokenizer (vLLM's
`POST /tokenize` at the server's root) and a window's prompt logprobs from `/v1/completions` with
`echo: true, max_tokens: 0` and both `logprobs: k` (OpenAI's legacy echo) and `prompt_logprobs: k`
(vLLM's). vLLM's shape is read where the reply has it: its top-k are keyed by token id; OpenAI's
echo keys them by text, so two tokens with the same text count as one."""

from __future__ import annotations

import httpx

from tools.bench.targets import Target, TargetError
from tools.quality.metrics import Position

TOKENIZE_CHARS = 2000  # text sent to /tokenize at a time: well inside a server's longest prompt
TIMEOUT = 600.0


class QualityError(RuntimeError):
    """A server that cannot be measured (no tokenizer endpoint, no prompt logprobs): its message
    says why."""


class Server:
    def __init__(self, spec: str, model: str | None, api_key: str | None = None):
        """`spec`: an OpenAI base URL (http://HOST:PORT/v1) or its /v1/completions, `label=` first
        to name it (tools/bench/targets.py)."""
        label, sep, url = spec.partition("=") if "=" in spec.split("://")[0] else ("", "", spec)
        if url.rstrip("/").endswith("/v1"):
            url = url.rstrip("/") + "/completions"
        try:
            target = Target.parse(f"{label}{sep}{url}").with_key(api_key)
        except TargetError as exc:
            raise QualityError(str(exc)) from exc
        if target.api != "completions":
            raise QualityError(f"{spec!r}: give the OpenAI base (http://HOST:PORT/v1)")
        self.target = target
        self.root = target.health_url.removesuffix("/health")
        self.client = httpx.Client(headers=target.headers, timeout=TIMEOUT)
        self.model = model or self._first_model()

    @property
    def label(self) -> str:
        return self.target.label

    def _first_model(self) -> str:
        try:
            models = self.client.get(f"{self.root}/v1/models").json()["data"]
        except (httpx.HTTPError, KeyError, TypeError, ValueError) as exc:
            raise QualityError(
                f"{self.label}: no --model given and /v1/models did not name one: {exc}"
            ) from exc
        if not models:
            raise QualityError(f"{self.label}: /v1/models lists no model")
        return models[0]["id"]

    def _post(self, path: str, body: dict, what: str) -> dict:
        try:
            reply = self.client.post(f"{self.root}{path}", json=body)
        except httpx.HTTPError as exc:
            raise QualityError(f"{self.label}: {path} failed: {exc}") from exc
        if reply.status_code != 200:
            raise QualityError(
                f"{self.label}: {what} ({path} answered {reply.status_code}: {reply.text[:300]})"
            )
        try:
            return reply.json()
        except ValueError as exc:
            raise QualityError(f"{self.label}: {what} ({path} answered no JSON)") from exc

    def tokenize(self, text: str) -> list[int]:
        """The text's token ids, tokenized a paragraph group at a time (no special tokens), so a long
        text stays within the server's prompt bound; a boundary falls between paragraphs."""
        ids: list[int] = []
        for chunk in chunks(text, TOKENIZE_CHARS):
            body = {"model": self.model, "prompt": chunk, "add_special_tokens": False}
            ids += self._post("/tokenize", body, "needs vLLM's POST /tokenize")["tokens"]
        return ids

    def score(self, ids: list[int], k: int) -> list[Position]:
        """The Position of each token of the prompt `ids` after the first (nothing precedes that)."""
        body = {
            "model": self.model,
            "prompt": ids,
            "max_tokens": 0,
            "temperature": 0,
            "echo": True,
            "logprobs": k,
            "prompt_logprobs": k,
        }
        unsupported = "does not return prompt logprobs (echo with max_tokens 0, or prompt_logprobs)"
        reply = self._post("/v1/completions", body, unsupported)
        try:
            positions = read_positions(reply["choices"][0], ids)
        except (LookupError, TypeError, ValueError, AttributeError) as exc:
            raise QualityError(f"{self.label}: {unsupported}: a reply of another shape ({exc!r})") from exc
        scored = [p for p in positions[1 : len(ids)] if p is not None]
        if len(scored) != len(ids) - 1:
            raise QualityError(f"{self.label}: {unsupported}: {len(scored)} of {len(ids) - 1} tokens scored")
        return scored


def read_positions(choice: dict, ids: list[int]) -> list[Position | None]:
    """A choice's prompt positions: vLLM's prompt_logprobs where present, else OpenAI's echo."""
    if choice.get("prompt_logprobs"):
        return [vllm_position(ids[i], e) if e else None for i, e in enumerate(choice["prompt_logprobs"])]
    echoed = choice.get("logprobs") or {}
    return [
        Position(float(value), {str(t): float(v) for t, v in top.items()})
        if value is not None and top
        else None
        for value, top in zip(echoed.get("token_logprobs") or [], echoed.get("top_logprobs") or [])
    ]


def vllm_position(token: int, entry: dict) -> Position:
    """One of vLLM's prompt_logprobs entries ({id: {logprob, rank, decoded_token}})."""
    top = {str(key): float(value["logprob"]) for key, value in entry.items()}
    return Position(top[str(token)], top)


def chunks(text: str, size: int) -> list[str]:
    """`text` cut after paragraph ends ("\\n\\n") into pieces of about `size` characters (a longer
    paragraph cut after a line end or a space, else anywhere); joined they are `text`."""
    pieces: list[str] = []
    while len(text) > size:
        for sep in ("\n\n", "\n", " "):
            cut = text.rfind(sep, 0, size)
            if cut > 0:
                cut += len(sep)
                break
        else:
            cut = size
        pieces.append(text[:cut])
        text = text[cut:]
    return pieces + ([text] if text else [])
