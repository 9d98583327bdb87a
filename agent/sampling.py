"""Per-sequence token choice from the top-k post-process graph's candidates.

The device returns the K best (logit, id) pairs of each row, best first; each sequence then applies
its own repetition penalty, top-k, temperature and top-p with its own seeded RNG, so a seeded request
gives the same text whatever else shares its batch.

Penalties: `repetition_penalty` (CTRL-style, over prompt and output tokens) and OpenAI's
`presence_penalty` / `frequency_penalty` (subtracted from the logits of output tokens, once and per
occurrence). Exactness: penalties only lower the logits of tokens already seen (so OpenAI's negative
values are refused), hence the true top-k after them lies within the top (k + number of seen tokens)
before them; `candidates_needed` asks for that many, and the whole vocabulary when no top-k applies.

A row that needs the whole vocabulary does not run a top-k over it on the device (13-23 ms for a
batch of 32 with a 49152-token vocabulary, paid by every row of the batch): `choose_from_logits`
takes its logits row and draws from the same distribution on the host, sorting only the tokens the
draw can reach (none without top-p, the nucleus with it).
"""

from __future__ import annotations

import json

import numpy as np

from agent.contract.sampling import SamplingParams


class SlotSampler:
    """Chooses the tokens of one sequence: its parameters, its RNG and the tokens it has seen."""

    def __init__(self, params: SamplingParams, prompt: list[int], vocab_size: int):
        self.params = params
        self.vocab_size = vocab_size
        self.rng = np.random.default_rng(params.seed)
        self.repetition = params.repetition_penalty != 1.0
        self.counted = params.presence_penalty > 0 or params.frequency_penalty > 0
        self.penalised = self.repetition or self.counted
        self.seen: set[int] = set(prompt) if self.repetition else set()
        self.counts: dict[int, int] = {}  # output tokens, for presence/frequency penalties

    @property
    def plain_greedy(self) -> bool:
        """Greedy without a penalty: the argmax graph's answer is final."""
        return self.params.greedy and not self.penalised

    def candidates_needed(self) -> int:
        p = self.params
        if p.greedy:
            k = 1
        elif p.top_k > 0:
            k = p.top_k
        else:
            return self.vocab_size
        return min(self.vocab_size, k + len(self.seen) + len(self.counts))

    def choose(self, values: np.ndarray, ids: np.ndarray) -> int:
        """values/ids: this row's candidates, best first (at least candidates_needed() of them)."""
        p = self.params
        logits = values.astype(np.float64)
        if self.penalised:
            if self.seen:
                seen = np.fromiter(self.seen, dtype=np.int64, count=len(self.seen))
                hit = np.isin(ids, seen)
                penalised = np.where(logits > 0, logits / p.repetition_penalty, logits * p.repetition_penalty)
                logits = np.where(hit, penalised, logits)
            if self.counts:
                penalty = np.zeros(self.vocab_size)
                tokens = np.fromiter(self.counts.keys(), dtype=np.int64, count=len(self.counts))
                occurrences = np.fromiter(self.counts.values(), dtype=np.float64, count=len(self.counts))
                penalty[tokens] = p.presence_penalty + p.frequency_penalty * occurrences
                logits = logits - penalty[ids]
            order = np.argsort(-logits, kind="stable")
            logits, ids = logits[order], ids[order]
        if p.greedy:
            token = int(ids[0])
        else:
            if p.top_k > 0:
                logits, ids = logits[: p.top_k], ids[: p.top_k]
            probs = np.exp((logits - logits[0]) / p.temperature)
            cumulative = np.cumsum(probs)
            cumulative /= cumulative[-1]
            if p.top_p < 1.0:
                keep = int(np.searchsorted(cumulative, p.top_p)) + 1
                cumulative = cumulative[:keep] / cumulative[keep - 1]
            index = int(np.searchsorted(cumulative, self.rng.random(), side="right"))
            token = int(ids[min(index, len(cumulative) - 1)])
        self.observe(token)
        return token

    def choose_from_logits(self, row: np.ndarray) -> int:
        """The choice choose() makes, from the row's logits for every token (indexed by id)."""
        logits = self._penalised(row.astype(np.float64))
        if self.params.greedy:
            token = int(np.argmax(logits))
        else:
            token = self._draw(np.exp((logits - logits.max()) / self.params.temperature))
        self.observe(token)
        return token

    def _penalised(self, logits: np.ndarray) -> np.ndarray:
        p = self.params
        if self.seen:
            seen = np.fromiter(self.seen, dtype=np.int64, count=len(self.seen))
            hit = logits[seen]
            logits[seen] = np.where(hit > 0, hit / p.repetition_penalty, hit * p.repetition_penalty)
        if self.counts:
            tokens = np.fromiter(self.counts.keys(), dtype=np.int64, count=len(self.counts))
            occurrences = np.fromiter(self.counts.values(), dtype=np.float64, count=len(self.counts))
            logits[tokens] -= p.presence_penalty + p.frequency_penalty * occurrences
        return logits

    def _draw(self, probs: np.ndarray) -> int:
        """One draw (one RNG number, as in choose()) from unnormalised probabilities by token id."""
        p = self.params
        if p.top_k == 0 and p.top_p >= 1.0:  # no truncation: the id order serves as well as any
            cumulative = np.cumsum(probs)
            index = int(np.searchsorted(cumulative, self.rng.random() * cumulative[-1], side="right"))
            return min(index, len(probs) - 1)
        ids, cumulative = _nucleus(probs, p.top_k or len(probs), p.top_p)
        index = int(np.searchsorted(cumulative, self.rng.random(), side="right"))
        return int(ids[min(index, len(ids) - 1)])

    def state(self) -> dict:
        """All a decode agent needs to go on choosing this sequence's tokens exactly as this one
        would (PD disaggregation), in msgpack's types: the RNG's 128-bit state travels as JSON."""
        return {
            "params": self.params.model_dump(),
            "seen": sorted(self.seen),
            "counts": [[token, n] for token, n in self.counts.items()],
            "rng": json.dumps(self.rng.bit_generator.state),
        }

    @classmethod
    def from_state(cls, state: dict, vocab_size: int) -> SlotSampler:
        """The inverse of state(); a malformed state raises ValueError, TypeError or KeyError."""
        sampler = cls(SamplingParams.model_validate(state["params"]), [], vocab_size)
        sampler.seen = {int(t) for t in state["seen"]}
        sampler.counts = {int(t): int(n) for t, n in state["counts"]}
        sampler.rng.bit_generator.state = json.loads(state["rng"])
        return sampler

    def observe(self, token: int) -> None:
        if self.repetition:
            self.seen.add(token)
        if self.counted:
            self.counts[token] = self.counts.get(token, 0) + 1


FIRST_NUCLEUS_GUESS = 64


def _nucleus(probs: np.ndarray, top_k: int, top_p: float) -> tuple[np.ndarray, np.ndarray]:
    """The ids a top-k then top-p draw can reach, best first, with their cumulative share (ending
    at 1). Sorts a growing prefix of the best tokens until it holds the nucleus, not the vocabulary."""
    kept = np.argpartition(-probs, top_k - 1)[:top_k] if top_k < len(probs) else np.arange(len(probs))
    total = probs[kept].sum()
    size = min(top_k, FIRST_NUCLEUS_GUESS)
    while True:
        best = kept if size == top_k else kept[np.argpartition(-probs[kept], size - 1)[:size]]
        ids = best[np.lexsort((best, -probs[best]))]  # best first, ties by id
        cumulative = np.cumsum(probs[ids]) / total
        if size == top_k or (top_p < 1.0 and cumulative[-1] >= top_p):
            break
        size = min(top_k, size * 8)
    if top_p < 1.0:
        keep = min(int(np.searchsorted(cumulative, top_p)) + 1, len(ids))
        ids, cumulative = ids[:keep], cumulative[:keep]
    return ids, cumulative / cumulative[-1]
