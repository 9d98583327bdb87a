"""Generated tokens with their logprobs in each API's shape: OpenAI chat (`logprobs.content`),
OpenAI completions (`tokens`, `token_logprobs`, `top_logprobs`, `text_offset`) and TGI's token
objects (`id`, `text`, `logprob`, `special`). The values come from the agents (agent/sampling.py).

A prompt's logprobs (agent/contract/prompt_logprobs.py: one entry per position but the first) in
the same shapes: OpenAI completions' `echo` (the first token's logprob and top_logprobs null),
vLLM's `prompt_logprobs` (None, then per position {id: {logprob, rank, decoded_token}} of its token
and the k best) and TGI's `details.prefill` ({id, text, logprob}, the first logprob null)."""

from __future__ import annotations

from agent.contract.prompt_logprobs import PromptLogprob
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

    def echo(self, ids: list[int], entries: list[PromptLogprob], k: int) -> dict:
        """OpenAI completions `logprobs` of an echoed prompt (`entries`: positions 1..; `k` best
        shown of each), its text offsets from 0."""
        out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        offset = 0
        for position, token in enumerate(ids):
            text = self.tokenizer.token_piece(token)[0]
            entry = entries[position - 1] if 0 < position <= len(entries) else None
            out["tokens"].append(text)
            out["token_logprobs"].append(None if entry is None else entry.logprob)
            out["top_logprobs"].append(
                None if entry is None else {self.tokenizer.token_piece(i)[0]: v for i, v in entry.top[:k]}
            )
            out["text_offset"].append(offset)
            offset += len(text)
        return out

    def vllm_prompt(self, ids: list[int], entries: list[PromptLogprob], k: int) -> list[dict | None]:
        """vLLM's `prompt_logprobs`: None for the first position, then each position's token and
        its `k` best, by id, each with its logprob, rank (1: the most likely) and text."""
        out: list[dict | None] = [None]
        for token, entry in zip(ids[1:], entries):
            ranked = {t: (v, rank) for rank, (t, v) in enumerate(entry.top[:k], start=1)}
            ranked[token] = (entry.logprob, entry.rank)
            out.append(
                {
                    str(t): {"logprob": v, "rank": rank, "decoded_token": self.tokenizer.token_piece(t)[0]}
                    for t, (v, rank) in ranked.items()
                }
            )
        return out

    def tgi_prefill(self, ids: list[int], entries: list[PromptLogprob]) -> list[dict]:
        """TGI's `details.prefill`: the prompt's tokens, the first one's logprob null."""
        return [
            {
                "id": token,
                "text": self.tokenizer.token_piece(token)[0],
                "logprob": entries[position - 1].logprob if 0 < position <= len(entries) else None,
            }
            for position, token in enumerate(ids)
        ]

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
