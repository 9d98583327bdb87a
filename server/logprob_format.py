"""Generated tokens with their logprobs in each API's shape: OpenAI chat (`logprobs.content`),
OpenAI completions (`tokens`, `token_logprobs`, `top_logprobs`, `text_offset`) and TGI's token
objects (`id`, `text`, `logprob`, `special`). The values come from the agents (agent/sampling.py)."""

from __future__ import annotations

from agent.contract.sampling import TokenLogprob
from agent.model.tokenizer import TextTokenizer
from server.output import GeneratedToken


class LogprobFormatter:
    def __init__(self, tokenizer: TextTokenizer):
        self.tokenizer = tokenizer

    def chat(self, tokens: list[GeneratedToken]) -> list[dict]:
        """OpenAI chat `logprobs.content` items, one per token."""
        return [
            {**self._openai(t.id, entry.logprob), "top_logprobs": [self._openai(i, v) for i, v in entry.top]}
            for t, entry in self._entries(tokens)
        ]

    def completion(self, tokens: list[GeneratedToken], text_offset: int) -> dict:
        """OpenAI completions `logprobs` of these tokens, the first at `text_offset` characters."""
        out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for t, entry in self._entries(tokens):
            text = self.tokenizer.token_piece(t.id)[0]
            out["tokens"].append(text)
            out["token_logprobs"].append(entry.logprob)
            out["top_logprobs"].append({self.tokenizer.token_piece(i)[0]: v for i, v in entry.top})
            out["text_offset"].append(text_offset)
            text_offset += len(text)
        return out

    def tgi(self, token: int, logprob: float | None) -> dict:
        """A TGI token object (logprob null when the request did not ask for details)."""
        text, _, special = self.tokenizer.token_piece(token)
        return {"id": token, "text": text, "logprob": logprob, "special": special}

    def tgi_top(self, entry: TokenLogprob | None) -> list[dict]:
        return [] if entry is None else [self.tgi(i, v) for i, v in entry.top]

    def _openai(self, token: int, logprob: float) -> dict:
        text, raw, _ = self.tokenizer.token_piece(token)
        return {"token": text, "logprob": logprob, "bytes": list(raw)}

    @staticmethod
    def _entries(tokens: list[GeneratedToken]) -> list[tuple[GeneratedToken, TokenLogprob]]:
        return [(t, t.logprob) for t in tokens if t.logprob is not None]
