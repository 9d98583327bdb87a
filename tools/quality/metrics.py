"""The numbers `python -m tools.quality` reports, from per-position logprobs.

A scored position is the logprob of the text's own token there and the k best next tokens the
server reported (their logprobs, keyed by token id, or by text where a server gives only text).

KL divergence is the top-k approximation of llama-perplexity's `--kl-divergence`, which has the
whole vocabulary's distribution; servers give each position's k best alone. Each side's
distribution is completed over the union U of both sides' known ids plus one "rest" bucket: a known
id keeps its probability; an id the other side knows but this one does not gets an equal share of
this side's unreported mass (its remaining mass split over those ids and the bucket, each share at
most this side's least known probability, since an unreported id ranks below all reported ones);
the bucket takes what is left. Both are floored at 1e-10 and renormalised, then
KL(reference || target) = sum_i p_i log(p_i / q_i) over U and the bucket. With k covering the whole
vocabulary this is the exact KL; with small k it is an estimate whose error goes either way (the
default model, int8 against float32 activations, the first 20,700 tokens of the default text:
0.0037 at top-20 where the whole vocabulary gives 0.0026). python -m tools.quality.exact gives
the exact number for one file in two activation modes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

FLOOR = 1e-10  # a probability no side reported: keeps log(p/q) finite


@dataclass(frozen=True)
class Position:
    logprob: float  # the text's own token
    top: dict[str, float]  # the k best (and the text's token where reported): key -> logprob

    @property
    def best(self) -> str:
        return max(self.top, key=self.top.__getitem__)


def perplexity(logprobs: list[float]) -> float:
    """exp of the mean negative logprob of the scored tokens."""
    if not logprobs:
        raise ValueError("no tokens scored")
    return math.exp(-math.fsum(logprobs) / len(logprobs))


def completed(known: dict[str, float], keys: list[str]) -> np.ndarray:
    """`known` (logprobs) as probabilities over `keys` plus a last bucket for the rest, by the
    module docstring's rule."""
    probs = {k: math.exp(v) for k, v in known.items()}
    rest = max(1.0 - math.fsum(probs.values()), 0.0)
    missing = [k for k in keys if k not in probs]
    share = min(rest / (len(missing) + 1), min(probs.values())) if missing and probs else 0.0
    vector = np.array([probs.get(k, share) for k in keys] + [rest - share * len(missing)])
    vector = np.maximum(vector, FLOOR)
    return vector / vector.sum()


def kl_top_k(reference: dict[str, float], target: dict[str, float]) -> float:
    """KL(reference || target) over the two sides' reported top-k (the module docstring's rule)."""
    keys = sorted(set(reference) | set(target))
    p, q = completed(reference, keys), completed(target, keys)
    return max(float(np.sum(p * (np.log(p) - np.log(q)))), 0.0)


def top1_agreement(reference: list[Position], target: list[Position]) -> float:
    """The share of positions where both sides' most likely next token is the same."""
    if len(reference) != len(target) or not target:
        raise ValueError("top-1 agreement needs the same, non-empty, positions on both sides")
    return sum(r.best == t.best for r, t in zip(reference, target)) / len(target)


def summary(target: list[Position], reference: list[Position] | None) -> dict:
    """The report's numbers: the target's perplexity and, against a reference, its perplexity,
    the mean and 99th-percentile KL and the top-1 agreement."""
    result: dict = {"tokens_scored": len(target), "perplexity": perplexity([p.logprob for p in target])}
    if reference is not None:
        kl = np.array([kl_top_k(r.top, t.top) for r, t in zip(reference, target)])
        result |= {
            "reference_perplexity": perplexity([p.logprob for p in reference]),
            "kl_mean": float(kl.mean()),
            "kl_p99": float(np.percentile(kl, 99)),
            "top1_agreement": top1_agreement(reference, target),
        }
    return result
