"""Proposal lengths (scheduler/speculation/proposal_length.py): each sequence proposes as many
tokens as pay for themselves in tokens per second, from its acceptance and the step costs; none
where none pays."""

import itertools
import random

import pytest

from config import load_config
from config.schema import SpeculationSection
from scheduler.speculation.ngram import NgramIndex, SpeculationState
from scheduler.speculation.proposal_length import (
    FALLBACK_STEP_TOKENS,
    Candidate,
    acceptance,
    age,
    choose_lengths,
    observe,
    proposal_lengths,
)
from scheduler.speculation.speculator import Speculator
from scheduler.speculation.verify_costs import PROBE_EVERY, VerifyCosts


def rate(step_s: float, fixed_s: float, decodes: int, candidates: list[Candidate], lengths) -> float:
    """The step's expected tokens per second with these lengths (the module's objective)."""
    tokens = decodes + sum(c.alpha ** (i + 1) for c, k in zip(candidates, lengths) for i in range(k))
    seconds = step_s + (fixed_s if any(lengths) else 0.0)
    seconds += sum(sum(c.extra[:k]) for c, k in zip(candidates, lengths))
    return tokens / seconds


def test_the_length_grows_with_acceptance_up_to_the_bound():
    lengths = [
        proposal_lengths(9.0, 0.0, 1, [Candidate(alpha, [1.0] * 8)])[0] for alpha in (0.1, 0.4, 0.7, 0.95)
    ]
    assert lengths == sorted(lengths) and lengths[0] < lengths[-1], lengths
    assert lengths[0] == 0 and lengths[-1] == 8  # 0.1 never beats a step's 1/9; 0.95^8 = 0.66 does


def test_the_length_shrinks_as_a_token_costs_more_and_is_zero_where_none_pays():
    lengths = [
        proposal_lengths(1.0, 0.0, 1, [Candidate(0.8, [cost] * 8)])[0] for cost in (0.01, 0.1, 0.3, 1.0)
    ]
    assert lengths == sorted(lengths, reverse=True) and lengths[0] == 8 and lengths[-1] == 0, lengths
    # a mixed step's fixed cost larger than what any proposal earns: none at all
    assert proposal_lengths(1.0, 10.0, 1, [Candidate(0.9, [0.01] * 8)]) == [0]


def test_under_load_proposals_stop_by_themselves():
    """The same sequences with the fallback costs: alone they propose; beside 60 other streams a
    step already earns 61 tokens, and no proposal beats that rate."""
    wanting = [(0.7, 4), (0.5, 4)]
    assert all(choose_lengths(None, 2, wanting))
    assert choose_lengths(None, 62, wanting) == [0, 0]


def test_greedy_lengths_reach_the_best_rate_of_every_choice():
    """Against brute force over every combination of lengths, for random small batches."""
    rng = random.Random(7)
    for _ in range(300):
        candidates = [
            Candidate(rng.uniform(0, 1), [rng.uniform(0.001, 0.3)] * rng.randint(1, 4))
            for _ in range(rng.randint(1, 3))
        ]
        step_s, fixed_s, decodes = (
            rng.uniform(0.05, 2),
            rng.choice([0.0, rng.uniform(0, 0.5)]),
            rng.randint(1, 8),
        )
        chosen = proposal_lengths(step_s, fixed_s, decodes, candidates)
        best = max(
            rate(step_s, fixed_s, decodes, candidates, lengths)
            for lengths in itertools.product(*(range(len(c.extra) + 1) for c in candidates))
        )
        assert rate(step_s, fixed_s, decodes, candidates, chosen) == pytest.approx(best, rel=1e-9)


def learned(a=0.020, b=0.0002, fixed=0.003, m=0.0003) -> VerifyCosts:
    """Verify costs learned from exact samples of a known linear model (its own terms)."""
    costs = VerifyCosts()
    rng = random.Random(3)
    for _ in range(200):
        rows, proposed = rng.randint(1, 16), rng.choice([0, 0, *range(1, 9)])
        costs.sampled(rows, proposed, a + b * rows + (fixed if proposed else 0.0) + m * proposed)
    return costs


def test_verify_costs_learn_the_step_the_switch_and_a_token():
    costs = learned()
    assert costs.decode_s(10) == pytest.approx(0.022, rel=1e-3)
    assert (costs.fixed_s, costs.token_s) == pytest.approx((0.003, 0.0003), rel=1e-3)
    unknown = VerifyCosts()
    unknown.sampled(4, 0, 0.02)  # no step that verifies yet: nothing to compare with
    assert (unknown.decode_s(4), unknown.fixed_s, unknown.token_s) == (None, 0.0, 0.0)


def test_one_proposal_length_seen_still_predicts_that_length():
    """Every step verified 4 tokens on one batch size: the switch and the tokens cannot be told
    apart, but what 4 tokens cost is still what the steps took."""
    costs = VerifyCosts()
    for _ in range(50):
        costs.sampled(2, 0, 0.020)
        costs.sampled(2, 4, 0.026)
    assert costs.decode_s(2) == pytest.approx(0.020, rel=1e-3)
    assert costs.fixed_s + 4 * costs.token_s == pytest.approx(0.006, rel=1e-2)


def test_learned_costs_decide_one_stream_proposes_many_and_a_busy_batch_none():
    """20 ms a step reading the weights, 3 ms to verify at all, 0.3 ms a token: one copying stream
    proposes the most it may; one whose proposals are seldom kept none; among 200 streams (a step
    earning 200 tokens in 60 ms) a token must be kept more often than its cost earns: none is."""
    costs = learned()
    assert choose_lengths(costs, 1, [(0.9, 8)]) == [8]
    assert choose_lengths(costs, 1, [(0.1, 8)]) == [0]
    assert choose_lengths(costs, 200, [(0.9, 8), (0.6, 8)]) == [0, 0]


def test_acceptance_follows_the_verified_steps_and_drifts_back_to_the_prior_at_rest():
    state = SpeculationState(NgramIndex(2, 4))
    prior = acceptance(state)
    assert prior == 0.5
    for _ in range(3):  # the first token of each proposal missed: three tokens' evidence
        age(state)
        observe(state, 4, 0)
    low = acceptance(state)
    assert low < 0.25
    for _ in range(30):  # at rest: the evidence fades
        age(state)
    assert low < acceptance(state) == pytest.approx(prior, abs=0.01)
    for _ in range(5):  # every token kept: twenty tokens' evidence
        age(state)
        observe(state, 4, 4)
    high = acceptance(state)
    assert high > 0.9
    age(state)
    observe(state, 4, 2)  # two kept, the third missed: a little lower
    assert 0.8 < acceptance(state) < high


def test_fallback_step_is_documented_and_ngram_is_the_default():
    assert FALLBACK_STEP_TOKENS == 8.0
    section = SpeculationSection()
    assert (section.method, section.num_tokens, section.max_batch, section.adaptive) == (
        "ngram",
        4,
        None,
        True,
    )
    assert load_config().runtime.speculation == section  # the shipped config/default.yaml
    assert Speculator(section).max_batch > 10_000  # no fixed cut: the costs decide
    draft = SpeculationSection(method="draft", draft_model="/nonexistent/draft")
    assert Speculator(draft).max_batch == 4 and not Speculator(SpeculationSection(method="none")).enabled


def test_costs_learned_on_slow_steps_are_measured_again_after_a_while():
    """Verifying once took 10x a decode step (a cold start, say): proposals stop; after
    PROBE_EVERY plain steps the lengths are chosen as if the costs were unknown, and once a step
    verified again the learned costs decide."""
    costs = VerifyCosts()
    costs.sampled(1, 0, 0.020)
    costs.sampled(1, 4, 0.200)
    assert choose_lengths(costs, 1, [(0.5, 4)]) == [0]
    for _ in range(PROBE_EVERY - 1):
        costs.sampled(1, 0, 0.020)
    assert choose_lengths(costs, 1, [(0.5, 4)]) == [0]
    costs.sampled(1, 0, 0.020)
    probe = choose_lengths(costs, 1, [(0.5, 4)])
    assert probe == choose_lengths(None, 1, [(0.5, 4)]) and probe[0] > 0
    for _ in range(20):  # now verifying costs little
        costs.sampled(1, probe[0], 0.021)
    assert not costs.probe_due and choose_lengths(costs, 1, [(0.5, 4)])[0] > 0
