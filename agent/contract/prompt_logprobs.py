"""Prompt logprobs (OpenAI's `echo` with `logprobs`, vLLM's `prompt_logprobs`, TGI's
`decoder_input_details`): for each prompt position p > 0, the log-softmax of the model's logits at
position p - 1 evaluated at the prompt's token p, its rank among all tokens (1: the most likely) and
the k most likely tokens there. Position 0 has none (nothing comes before it).

These are the model's own distribution (raw logits, temperature 1, no penalties or bias): what a
greedy request without penalties reports for the tokens it generates (agent/sampling.py), so the
prompt's logprobs of a text equal the logprobs its greedy generation reported.

The agent computes them from every row's logits of a prompt chunk's prefill (agent/runner.py,
`score_rows` here); the wire carries only these values (StepReply's `chunk_prompt_logprobs`).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np

from agent.contract.sampling import MAX_LOGPROBS

# Rows of logits taken through the float64 log-softmax at once: bounds the host's temporary memory
# (64 rows x a 152k vocabulary x 8 bytes: 78 MB) whatever the chunk's length.
SCORE_ROWS = 64


class PromptLogprob(NamedTuple):
    """One prompt position's logprob: its token's, that token's rank, and the `k` best (id, logprob),
    best first."""

    logprob: float
    rank: int
    top: tuple[tuple[int, float], ...] = ()

    def to_wire(self) -> list:
        return [self.logprob, self.rank, [[token, value] for token, value in self.top]]

    @classmethod
    def from_wire(cls, value, vocab_size: int | None = None) -> PromptLogprob:
        """The inverse of to_wire(); anything else (a value that is no logprob, a token outside the
        vocabulary) raises ValueError."""
        try:
            logprob, rank, top = value
            entry = cls(float(logprob), int(rank), tuple((int(t), float(v)) for t, v in top))
        except (TypeError, ValueError) as e:
            raise ValueError(f"not a prompt logprob: {value!r:.200}") from e
        values = [entry.logprob] + [v for _, v in entry.top]
        if (
            len(entry.top) > MAX_LOGPROBS
            or entry.rank < 1
            or (
                vocab_size is not None
                and (entry.rank > vocab_size or any(not 0 <= t < vocab_size for t, _ in entry.top))
            )
            or not all(math.isfinite(v) and v <= 0 for v in values)
        ):
            raise ValueError(f"not a prompt logprob: {value!r:.200}")
        return entry


def score_rows(logits: np.ndarray, targets: np.ndarray, k: int) -> list[PromptLogprob]:
    """Row i of `logits` [rows, vocab] (the logits after a position) scored at token targets[i]:
    its log-softmax in float64 (shifted by the row's peak, as agent/sampling.py computes a sampled
    token's), its rank and the k best tokens (ties by id)."""
    out: list[PromptLogprob] = []
    for first in range(0, len(targets), SCORE_ROWS):
        block = logits[first : first + SCORE_ROWS].astype(np.float64)
        shifted = block - block.max(axis=1, keepdims=True)
        normaliser = np.log(np.exp(shifted).sum(axis=1))
        for row, target in zip(range(len(block)), targets[first : first + SCORE_ROWS]):
            values = shifted[row] - normaliser[row]
            value = float(values[target])
            rank = int(np.count_nonzero(values > value)) + 1
            top: tuple[tuple[int, float], ...] = ()
            if k:
                ids = np.argpartition(-values, k - 1)[:k] if k < len(values) else np.arange(len(values))
                ids = ids[np.lexsort((ids, -values[ids]))]
                top = tuple((int(t), float(values[t])) for t in ids)
            out.append(PromptLogprob(value, rank, top))
    return out
