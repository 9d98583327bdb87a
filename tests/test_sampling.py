"""SlotSampler on fixed candidate lists: distributions, top-k/top-p truncation, seeds, penalties."""

import numpy as np
import pytest

from agent.contract.sampling import SamplingParams
from agent.sampling import SlotSampler

pytestmark = pytest.mark.unit

VOCAB = 1000


def candidates(logits: np.ndarray):
    order = np.argsort(-logits, kind="stable")
    return logits[order].astype(np.float32), order.astype(np.int32)


def draw(params, logits, n):
    sampler = SlotSampler(params, [], VOCAB)
    values, ids = candidates(logits)
    return np.array([sampler.choose(values, ids) for _ in range(n)])


def expected(logits, temperature=1.0, top_k=0, top_p=1.0):
    """HF warper order: top-k, then top-p over the renormalised survivors."""
    order = np.argsort(-logits, kind="stable")
    if top_k:
        order = order[:top_k]
    probs = np.exp((logits[order] - logits[order][0]) / temperature)
    probs /= probs.sum()
    keep = len(order)
    if top_p < 1.0:
        keep = int(np.searchsorted(np.cumsum(probs), top_p)) + 1
    out = np.zeros(VOCAB)
    out[order[:keep]] = probs[:keep] / probs[:keep].sum()
    return out


@pytest.mark.parametrize(
    "temperature, top_k, top_p", [(1.0, 0, 1.0), (0.7, 5, 1.0), (1.3, 0, 0.6), (1.0, 8, 0.8)]
)
def test_empirical_distribution_matches(temperature, top_k, top_p):
    rng = np.random.default_rng(0)
    logits = np.full(VOCAB, -20.0)
    logits[:12] = rng.normal(0, 1.0, 12)  # a few plausible tokens, the rest negligible
    params = SamplingParams(do_sample=True, temperature=temperature, top_k=top_k, top_p=top_p, seed=7)
    n = 20_000
    counts = np.bincount(draw(params, logits, n), minlength=VOCAB) / n
    want = expected(logits, temperature, top_k, top_p)
    assert np.all(counts[want == 0] == 0), "a token outside top-k/top-p was drawn"
    assert np.abs(counts - want).max() < 0.015


def test_same_seed_same_draws_and_different_seed_differs():
    logits = np.random.default_rng(1).normal(0, 2, VOCAB)
    params = SamplingParams(do_sample=True, seed=42)
    a, b = draw(params, logits, 50), draw(params, logits, 50)
    c = draw(params.model_copy(update={"seed": 43}), logits, 50)
    assert np.array_equal(a, b) and not np.array_equal(a, c)


def test_candidates_needed_covers_penalised_tokens():
    p = SamplingParams(do_sample=True, top_k=10, repetition_penalty=1.3)
    sampler = SlotSampler(p, [1, 2, 3, 3], VOCAB)
    assert sampler.candidates_needed() == 13
    assert SlotSampler(SamplingParams(do_sample=True), [], VOCAB).candidates_needed() == VOCAB
    assert SlotSampler(SamplingParams(), [], VOCAB).candidates_needed() == 1
    assert SlotSampler(SamplingParams(), [], VOCAB).plain_greedy


def test_penalty_can_promote_a_lower_candidate():
    logits = np.zeros(VOCAB)
    logits[[5, 6]] = [4.0, 3.0]
    sampler = SlotSampler(SamplingParams(repetition_penalty=2.0), [5], VOCAB)
    values, ids = candidates(logits)
    assert sampler.choose(values[:2], ids[:2]) == 6  # 4/2 < 3
    assert sampler.seen == {5, 6}


def test_presence_and_frequency_penalties_follow_openai():
    """logit - presence * [count > 0] - frequency * count, over output tokens only."""
    logits = np.zeros(VOCAB)
    logits[[5, 6, 7]] = [4.0, 3.5, 2.0]
    params = SamplingParams(presence_penalty=0.4, frequency_penalty=0.5)
    sampler = SlotSampler(params, [6], VOCAB)  # the prompt is not penalised
    values, ids = candidates(logits)
    picks = [sampler.choose(values[: 3 + i], ids[: 3 + i]) for i in range(4)]
    scores = {5: 4.0, 6: 3.5, 7: 2.0}
    counts = {}
    want = []
    for _ in range(4):
        adjusted = {t: v - (0.4 + 0.5 * counts[t] if counts.get(t) else 0) for t, v in scores.items()}
        best = max(adjusted, key=lambda t: (adjusted[t], -t))
        counts[best] = counts.get(best, 0) + 1
        want.append(best)
    assert picks == want and len(set(picks)) > 1
    assert sampler.counts == counts and sampler.candidates_needed() == 1 + len(counts)


@pytest.mark.parametrize(
    "bad",
    [
        {"temperature": -1},
        {"top_p": 0},
        {"top_p": 1.5},
        {"top_k": -2},
        {"repetition_penalty": 0},
        {"seed": -1},
        {"presence_penalty": -0.5},
        {"frequency_penalty": 2.5},
    ],
)
def test_invalid_parameters_are_refused(bad):
    with pytest.raises(ValueError):
        SamplingParams(**bad)


def draw_from_logits(params, logits, n, prompt=()):
    sampler = SlotSampler(params, list(prompt), VOCAB)
    return np.array([sampler.choose_from_logits(logits.astype(np.float32)) for _ in range(n)])


@pytest.mark.parametrize(
    "temperature, top_k, top_p",
    [(1.0, 0, 1.0), (0.7, 5, 1.0), (1.3, 0, 0.6), (1.0, 8, 0.8), (1.0, 0, 0.9999)],
)
def test_whole_vocabulary_draws_on_the_host_match_the_distribution(temperature, top_k, top_p):
    """The host path (rows that would need a top-k over the whole vocabulary on the device) draws
    from the same distribution as the candidate path."""
    rng = np.random.default_rng(0)
    logits = np.full(VOCAB, -20.0)
    logits[rng.choice(VOCAB, 12, replace=False)] = rng.normal(0, 1.0, 12)  # scattered ids: no id order
    params = SamplingParams(do_sample=True, temperature=temperature, top_k=top_k, top_p=top_p, seed=7)
    n = 20_000
    counts = np.bincount(draw_from_logits(params, logits, n), minlength=VOCAB) / n
    want = expected(logits, temperature, top_k, top_p)
    assert np.all(counts[want == 0] == 0), "a token outside top-k/top-p was drawn"
    assert np.abs(counts - want).max() < 0.015


def test_whole_vocabulary_draws_reproduce_by_seed_and_use_one_number_each():
    logits = np.random.default_rng(1).normal(0, 2, VOCAB)
    params = SamplingParams(do_sample=True, seed=42, top_p=0.9)
    a, b = draw_from_logits(params, logits, 50), draw_from_logits(params, logits, 50)
    assert np.array_equal(a, b)
    assert not np.array_equal(a, draw_from_logits(params.model_copy(update={"seed": 43}), logits, 50))
    sampler = SlotSampler(params, [], VOCAB)
    sampler.choose_from_logits(logits)
    # one RNG number per token, as choose() uses: a PD transfer's sampler state carries on either path
    assert sampler.rng.bit_generator.state == _after_draws(42, 1)


def _after_draws(seed: int, n: int) -> dict:
    rng = np.random.default_rng(seed)
    rng.random(n)
    return rng.bit_generator.state


def test_penalties_on_the_host_path_equal_the_candidate_path():
    logits = np.random.default_rng(2).normal(0, 2, VOCAB)
    prompt = list(np.argsort(-logits)[:5])  # the best tokens are penalised: the answer moves
    params = SamplingParams(repetition_penalty=1.8, presence_penalty=0.5, frequency_penalty=0.3)
    on_candidates, on_logits = SlotSampler(params, prompt, VOCAB), SlotSampler(params, prompt, VOCAB)
    values, ids = candidates(logits)
    for _ in range(8):
        assert on_logits.choose_from_logits(logits.astype(np.float32)) == on_candidates.choose(values, ids)
