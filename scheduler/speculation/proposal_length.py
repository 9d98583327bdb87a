"""How many tokens each decoding sequence proposes in a step (n-gram speculation): as many as pay
for themselves in tokens per second, from each sequence's acceptance and what proposals cost the
group's steps (scheduler/speculation/verify_costs.py).

A sequence's acceptance α is the chance that a proposed token is kept given the one before it was:
a Beta estimate from its verified steps (k kept of p proposed: k kept, and one missed when k < p),
whose counts decay by DECAY every step, so it follows the answer (a copy starts or ends) and drifts
back to the prior, PRIOR_KEPT / (PRIOR_KEPT + PRIOR_MISSED), while the sequence proposes nothing.
The i-th token of a proposal is then kept with probability α^i.

A step of n decode rows takes T0 seconds; proposals add a fixed F once (the step runs the mixed
graph) and m a proposed token, as the group's VerifyCosts learned them
(scheduler/speculation/verify_costs.py).
The lengths k_s maximise the step's expected tokens per second,

    (n + sum_s sum_{i <= k_s} α_s^i) / (T0 + F [any k_s > 0] + m sum_s k_s),

found greedily: the tokens in order of α_s^i, while one adds more than the rate so far,
and the best of those prefixes (none at all included). So a token pays only where its chance beats
what a step's time already earns: with one stream and a copying answer most do; with many streams
a step already earns n tokens and few or none pay, so proposals stop by themselves under load.
Before the costs are known, and for a probe (a group whose steps verified nothing for a while:
scheduler/speculation/verify_costs.py), a step is taken to cost FALLBACK_STEP_TOKENS proposal tokens plus one
per decode row, and F nothing: a conservative guess (a real decode step reads all the weights, a
proposal token costs far less), so early proposals are few and stop beyond a few streams.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

from scheduler.speculation.ngram import SpeculationState
from scheduler.speculation.verify_costs import VerifyCosts

PRIOR_KEPT, PRIOR_MISSED = 1.0, 1.0  # α = 0.5 before any verified step, worth two tokens' evidence
DECAY = 0.8  # per step: the last ~5 steps weigh most
FALLBACK_STEP_TOKENS = 8.0


def acceptance(state: SpeculationState) -> float:
    """The sequence's α: the chance that a proposed token is kept, given the one before it was."""
    kept, missed = state.kept_weight + PRIOR_KEPT, state.missed_weight + PRIOR_MISSED
    return kept / (kept + missed)


def age(state: SpeculationState) -> None:
    """One step went by: older evidence weighs less."""
    state.kept_weight *= DECAY
    state.missed_weight *= DECAY


def observe(state: SpeculationState, proposed: int, kept: int) -> None:
    """A step verified `proposed` tokens and kept the first `kept`."""
    state.kept_weight += kept
    state.missed_weight += kept < proposed


@dataclass(frozen=True)
class Candidate:
    """A decoding sequence that may propose: its α, the most tokens it may propose, and what each
    of them would add to the step (seconds: the i-th token's is extra[i - 1])."""

    alpha: float
    extra: list[float]


def proposal_lengths(step_s: float, fixed_s: float, decodes: int, candidates: list[Candidate]) -> list[int]:
    """Each candidate's length k maximising the step's expected tokens per second (see above):
    `step_s` the step's seconds without proposals, `fixed_s` the seconds added once any is made."""
    lengths = [0] * len(candidates)
    if step_s <= 0 or not candidates:
        return lengths
    floor = 1e-3 * step_s  # a token never costs nothing (noise in the fit), so lengths stay bounded
    tokens, seconds = float(decodes), step_s + fixed_s
    best, best_taken = decodes / step_s, 0
    taken: list[int] = []  # candidates in the order their tokens were taken
    heap = [(-c.alpha / max(c.extra[0], floor), i, 1) for i, c in enumerate(candidates) if c.extra]
    heapq.heapify(heap)
    while heap:
        _, i, n = heapq.heappop(heap)
        c = candidates[i]
        gain, cost = c.alpha**n, max(c.extra[n - 1], floor)
        if gain / cost <= tokens / seconds:  # no token left adds more than the rate so far
            break
        tokens, seconds = tokens + gain, seconds + cost
        taken.append(i)
        if tokens / seconds > best:
            best, best_taken = tokens / seconds, len(taken)
        if n < len(c.extra):
            heapq.heappush(heap, (-(c.alpha ** (n + 1)) / max(c.extra[n], floor), i, n + 1))
    for i in taken[:best_taken]:
        lengths[i] += 1
    return lengths


def choose_lengths(costs: VerifyCosts | None, decodes: int, wanting: list[tuple[float, int]]) -> list[int]:
    """The lengths in a step of `decodes` rows for the sequences `wanting` to propose: (α, the most
    it may propose) each. From the group's learned `costs`, or the fallback before they are known."""
    step_s = None if costs is None else costs.decode_s(decodes)
    if costs is None or step_s is None or step_s <= 0 or costs.probe_due:
        candidates = [Candidate(alpha, [1.0] * limit) for alpha, limit in wanting]
        return proposal_lengths(FALLBACK_STEP_TOKENS + decodes, 0.0, decodes, candidates)
    candidates = [Candidate(alpha, [costs.token_s] * limit) for alpha, limit in wanting]
    return proposal_lengths(step_s, costs.fixed_s, decodes, candidates)
