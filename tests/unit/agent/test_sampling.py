"""SlotSampler on fixed candidate lists: distributions, top-k/typical-p/top-p/min-p truncation against a numpy
reference, seeds, penalties, batch invariance; the sampling parameters no sampler here implements."""

from pathlib import Path

import numpy as np
import pytest

from agent.contract.sampling import (
    UNSERVED_SAMPLING,
    UNSERVED_SETTINGS,
    SamplingParams,
    TokenLogprob,
    unserved_sampling,
)
from agent.sampling import SlotSampler

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


def test_a_top_k_past_a_small_vocabulary_draws_as_no_top_k():
    """A vocabulary smaller than the host path's first nucleus guess (512), and a top_k past it: the
    draws are those of no top_k (it once raised, failing every sequence of the step)."""
    vocab = 300
    logits = np.random.default_rng(3).normal(0, 2, vocab)
    huge = SlotSampler(SamplingParams(do_sample=True, seed=5, top_k=2**31 - 1), [], vocab)
    assert all(0 <= huge.choose_from_logits(logits) < vocab for _ in range(50))
    huge, none = (SamplingParams(do_sample=True, seed=5, top_k=k, top_p=0.9) for k in (2**31 - 1, 0))
    a, b = SlotSampler(huge, [], vocab), SlotSampler(none, [], vocab)
    draws = [(a.choose_from_logits(logits), b.choose_from_logits(logits)) for _ in range(50)]
    assert all(x == y for x, y in draws)


def test_whole_vocabulary_draws_reproduce_by_seed():
    logits = np.random.default_rng(1).normal(0, 2, VOCAB)
    params = SamplingParams(do_sample=True, seed=42, top_p=0.9)
    a, b = draw_from_logits(params, logits, 50), draw_from_logits(params, logits, 50)
    assert np.array_equal(a, b)
    assert not np.array_equal(a, draw_from_logits(params.model_copy(update={"seed": 43}), logits, 50))


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(do_sample=True, seed=5),
        SamplingParams(do_sample=True, seed=6, top_k=3),
        SamplingParams(do_sample=True, seed=7, top_k=40, top_p=0.8, temperature=1.4),
        SamplingParams(do_sample=True, seed=8, logprobs=1),
    ],
)
def test_a_seeded_sequence_draws_the_same_tokens_whether_its_proposals_are_verified_or_not(params):
    """Each position's draw is its own (seed, position): one token a step, on either path, and
    steps that verify proposals right or wrong give the same tokens. Drawn from one stateful
    generator, a verified step used one or two numbers a position and the text moved with load."""
    rows = np.random.default_rng(4).normal(0, 1.5, (60, VOCAB)).astype(np.float32)
    candidate, host = SlotSampler(params, [], VOCAB), SlotSampler(params, [], VOCAB)
    plain = [host.choose_from_logits(row) for row in rows]
    if params.top_k and not host.needs_logits:  # a top-k row's device candidates: the same tokens
        assert [candidate.choose(*candidates(row)) for row in rows] == plain
    verifying, tokens, at, step = SlotSampler(params, [], VOCAB), [], 0, 0
    while at < len(rows) - 4:
        right = plain[at : at + 3]
        proposed = right if step % 2 else [right[0], (right[1] + 1) % VOCAB, right[2]]  # one wrong
        kept = verifying.verify(rows[at : at + len(proposed) + 1], proposed)
        assert kept == plain[at : at + len(kept)] and len(kept) == (4 if step % 2 else 2)
        tokens, at, step = tokens + kept, at + len(kept), step + 1
    assert tokens == plain[:at] and verifying.generated == at


def test_penalties_on_the_host_path_equal_the_candidate_path():
    logits = np.random.default_rng(2).normal(0, 2, VOCAB)
    prompt = list(np.argsort(-logits)[:5])  # the best tokens are penalised: the answer moves
    params = SamplingParams(repetition_penalty=1.8, presence_penalty=0.5, frequency_penalty=0.3)
    on_candidates, on_logits = SlotSampler(params, prompt, VOCAB), SlotSampler(params, prompt, VOCAB)
    values, ids = candidates(logits)
    for _ in range(8):
        assert on_logits.choose_from_logits(logits.astype(np.float32)) == on_candidates.choose(values, ids)


def log_softmax(x: np.ndarray) -> np.ndarray:
    shifted = x - x.max()
    return shifted - np.log(np.exp(shifted).sum())


@pytest.mark.parametrize(
    "params",
    [SamplingParams(logprobs=5), SamplingParams(do_sample=True, temperature=0.7, seed=3, logprobs=20)],
)
def test_logprobs_are_the_log_softmax_of_the_distribution_drawn_from(params):
    logits = np.random.default_rng(4).normal(0, 3, VOCAB)
    sampler = SlotSampler(params, [], VOCAB)
    token = sampler.choose_from_logits(logits.astype(np.float32))
    scale = params.temperature if params.do_sample else 1.0
    reference = log_softmax(logits.astype(np.float32).astype(np.float64) / scale)
    entry = sampler.last
    assert entry is not None and entry.logprob == pytest.approx(reference[token], abs=1e-5)
    assert [t for t, _ in entry.top] == list(np.argsort(-reference, kind="stable")[: params.logprobs])
    assert [v for _, v in entry.top] == pytest.approx(
        sorted(reference, reverse=True)[: params.logprobs], abs=1e-5
    )
    if not params.do_sample:
        assert entry.top[0][0] == token  # greedy: the chosen token is the most likely


def test_logprobs_follow_the_penalties_applied():
    logits = np.random.default_rng(5).normal(0, 2, VOCAB)
    best = int(np.argmax(logits))
    sampler = SlotSampler(SamplingParams(repetition_penalty=3.0, logprobs=1), [best], VOCAB)
    token = sampler.choose_from_logits(logits)
    penalised = logits.copy()
    penalised[best] = penalised[best] / 3.0 if penalised[best] > 0 else penalised[best] * 3.0
    assert token == int(np.argmax(penalised)) != best
    assert sampler.last.logprob == pytest.approx(log_softmax(penalised)[token], abs=1e-5)


def test_logit_bias_moves_the_choice_and_needs_the_whole_row():
    logits = np.random.default_rng(6).normal(0, 2, VOCAB)
    best, lifted = int(np.argmax(logits)), int(np.argmin(logits))
    params = SamplingParams(logit_bias=((lifted, 100.0),))
    sampler = SlotSampler(params, [], VOCAB)
    assert sampler.needs_logits and not sampler.plain_greedy
    assert sampler.choose_from_logits(logits) == lifted
    banned = SlotSampler(SamplingParams(logit_bias=((best, -100.0),)), [], VOCAB)
    assert banned.choose_from_logits(logits) != best


def test_min_tokens_suppresses_eos_and_stop_token_ids_until_reached():
    eos, stop = 7, 9
    logits = np.zeros(VOCAB)
    logits[[eos, stop]] = [10.0, 9.0]  # EOS first, the stop id next, whenever they are allowed
    sampler = SlotSampler(SamplingParams(min_tokens=2, stop_token_ids=(stop,)), [], VOCAB, eos_ids=(eos,))
    first, second = sampler.choose_from_logits(logits), sampler.choose_from_logits(logits)
    assert {first, second}.isdisjoint({eos, stop})
    assert not sampler.needs_logits and sampler.choose_from_logits(logits) == eos


def test_token_ids_outside_the_vocabulary_are_refused():
    with pytest.raises(ValueError, match="outside the vocabulary"):
        SlotSampler(SamplingParams(logit_bias=((VOCAB, 1.0),)), [], VOCAB)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        SlotSampler(SamplingParams(stop_token_ids=(VOCAB + 5,)), [], VOCAB)


@pytest.mark.parametrize(
    "wire", [None, [0.5, []], [-1.0, [[1, float("nan")]]], [-1.0, [[1]]], [-1.0, [[1, -1.0]] * 21], "x"]
)
def test_malformed_logprob_entries_are_refused(wire):
    with pytest.raises(ValueError):
        TokenLogprob.from_wire(wire)


def test_a_logprob_entry_survives_the_wire():
    entry = TokenLogprob(-0.25, ((3, -0.25), (4, -1.5)))
    assert TokenLogprob.from_wire(entry.to_wire()) == entry


@pytest.mark.parametrize("spread", [0.1, 20.0, 200.0])
def test_top_logprobs_are_exact_however_peaked_the_row(spread):
    """The top tokens are searched near the peak first: rows where few (or no) others are near it."""
    logits = np.random.default_rng(7).normal(0, spread, VOCAB)
    logits[3] = logits.max() + 50  # one token far ahead of the rest
    sampler = SlotSampler(SamplingParams(logprobs=20), [], VOCAB)
    assert sampler.choose_from_logits(logits) == 3
    want = np.lexsort((np.arange(VOCAB), -logits.astype(np.float32)))[:20]
    assert [t for t, _ in sampler.last.top] == list(want)


# ----------------------------------------------------------------------------- numerics


def test_a_temperature_below_the_greedy_bound_is_greedy_with_finite_logprobs():
    """1e-300 divided every logit into +-inf and the logprobs into NaN; under 1e-5 it is greedy.
    Just above it, the logits scaled 1e5 times still give finite logprobs (float64, shifted)."""
    logits = np.random.default_rng(0).normal(0, 8, VOCAB)
    tiny = SamplingParams(do_sample=True, temperature=1e-300, logprobs=3)
    assert tiny.greedy
    sampler = SlotSampler(tiny, [], VOCAB)
    assert sampler.choose_from_logits(logits.copy()) == int(np.argmax(logits))
    assert sampler.last is not None
    assert sampler.last.logprob == pytest.approx(-np.log(np.exp(logits - logits.max()).sum()), abs=1e-9)
    cold = SlotSampler(SamplingParams(do_sample=True, temperature=1.5e-5, logprobs=20, seed=1), [], VOCAB)
    cold.choose_from_logits(logits.copy())
    assert cold.last is not None
    assert np.isfinite([cold.last.logprob, *(v for _, v in cold.last.top)]).all()


@pytest.mark.parametrize(
    "field, value",
    [
        ("temperature", 101.0),
        ("repetition_penalty", 1e-300),
        ("repetition_penalty", 101.0),
        ("presence_penalty", 2.5),
        ("frequency_penalty", -0.1),
    ],
)
def test_sampling_values_past_their_bounds_are_refused(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_a_mask_that_allows_only_what_min_tokens_keeps_out_is_that_sequences_fault():
    """The grammar allows EOS and a stop id, min_tokens keeps both out: nothing is left. The
    choice fails with a request fault naming why (the runner makes it that sequence's error)."""
    from agent.sampling import SamplingFault

    eos, stop = 7, 9
    sampler = SlotSampler(SamplingParams(min_tokens=3, stop_token_ids=(stop,)), [], VOCAB, eos_ids=[eos])
    mask = np.zeros((VOCAB + 31) // 32, np.int32)
    for token in (eos, stop):
        mask[token // 32] |= 1 << (token % 32)
    sampler.constrain(mask)
    with pytest.raises(SamplingFault, match="min_tokens") as fault:
        sampler.choose_from_logits(np.zeros(VOCAB))
    assert fault.value.fault().kind == "request"


# ----------------------------------------------------------------------------- min_p and typical_p


def reference_distribution(logits, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, typical_p=1.0):
    """An independent numpy reference of the truncations, in llama.cpp's chain order on the
    temperature-scaled distribution: top-k; typical_p as transformers' TypicalLogitsWarper writes it
    (log-softmax, entropy, |surprisal - entropy| ascending, cumulative mass below typical_p plus one,
    ties with the last kept); top-p (the smallest best-first prefix reaching it); min_p as vLLM's
    _apply_min_p (probability below min_p times the largest remaining one removed)."""
    scaled = logits.astype(np.float64) / temperature
    allowed = np.ones(len(scaled), bool)
    if top_k:
        allowed &= scaled >= np.sort(scaled)[-top_k]

    def probs():
        p = np.where(allowed, np.exp(scaled - scaled[allowed].max()), 0.0)
        return p / p.sum()

    if typical_p < 1.0:
        masked = np.where(allowed, scaled, -np.inf)
        normalized = masked - (masked.max() + np.log(np.exp(masked - masked.max()).sum()))
        p = np.exp(normalized)
        with np.errstate(invalid="ignore"):
            entropy = -np.nansum(normalized * p)
        shifted = np.abs(-normalized - entropy)
        sorted_indices = np.argsort(shifted, kind="stable")
        sorted_scores = shifted[sorted_indices]
        cumulative = np.cumsum(p[sorted_indices])
        last_ind = min(int((cumulative < typical_p).sum()), len(scaled) - 1)
        allowed[sorted_indices[sorted_scores > sorted_scores[last_ind]]] = False
    if top_p < 1.0:
        p = probs()
        order = np.argsort(-p, kind="stable")
        keep = int(np.searchsorted(np.cumsum(p[order]), top_p)) + 1
        allowed[order[keep:]] = False
    if min_p > 0.0:
        p = probs()
        allowed &= p >= min_p * p.max()
    return probs()


class ScriptedDraws(SlotSampler):
    """A sampler whose draws are given: the token each uniform picks shows its distribution."""

    def __init__(self, params, draws):
        super().__init__(params, [], VOCAB)
        self.draws = iter(draws)

    def uniform(self) -> float:
        return next(self.draws)


def picks(params, logits, draws, path):
    sampler = ScriptedDraws(params, draws)
    if path == "whole row":
        return [sampler.choose_from_logits(logits.astype(np.float32)) for _ in draws]
    values, ids = candidates(logits)
    return [sampler.choose(values, ids) for _ in draws]


TRUNCATIONS = [
    {"min_p": 0.05},
    {"min_p": 0.3},
    {"min_p": 1.0},
    {"min_p": 0.1, "temperature": 0.5},
    {"typical_p": 0.2},
    {"typical_p": 0.5},
    {"typical_p": 0.95},
    {"typical_p": 0.9, "temperature": 1.7},
    {"typical_p": 0.7, "top_k": 40},
    {"typical_p": 0.8, "top_p": 0.7, "min_p": 0.02},
    {"min_p": 0.01, "top_p": 0.9, "top_k": 100},
    {"typical_p": 0.3, "min_p": 0.5, "temperature": 1.3},
]


@pytest.mark.parametrize("path", ["candidates", "whole row"])
@pytest.mark.parametrize("truncation", TRUNCATIONS)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_min_p_and_typical_p_keep_the_reference_distribution(seed, truncation, path):
    """For random logits, the tokens a draw can reach and each one's share equal the numpy
    reference's: a uniform in the middle of each allowed token's interval (best first, ties by
    id) picks that token, and one just below 1 picks the last of them (nothing else is reachable)."""
    logits = np.random.default_rng(seed).normal(0, 2.5, VOCAB).astype(np.float32)
    want = reference_distribution(logits.astype(np.float64), **truncation)
    allowed = np.lexsort((np.arange(VOCAB), -want))[: int(np.count_nonzero(want))]
    assert 0 < len(allowed) < VOCAB  # each case truncates something
    upper = np.cumsum(want[allowed])
    middles = upper - want[allowed] / 2
    params = SamplingParams(do_sample=True, seed=1, **truncation)
    got = picks(params, logits, [*middles, 1 - 1e-12], path)
    assert got == [*allowed.tolist(), int(allowed[-1])]


@pytest.mark.parametrize("truncation", TRUNCATIONS)
def test_seeded_draws_pick_only_allowed_tokens_in_their_share(truncation):
    rng = np.random.default_rng(5)
    logits = np.full(VOCAB, -20.0)
    logits[rng.choice(VOCAB, 40, replace=False)] = rng.normal(0, 1.5, 40)
    want = reference_distribution(logits, **truncation)
    n = 20_000
    params = SamplingParams(do_sample=True, seed=11, **truncation)
    for draws in (draw(params, logits, n), draw_from_logits(params, logits, n)):
        counts = np.bincount(draws, minlength=VOCAB) / n
        assert np.all(counts[want == 0] == 0), "a token outside the truncation was drawn"
        assert np.abs(counts - want).max() < 0.015


def test_typical_p_may_drop_the_most_likely_token():
    """Locally typical sampling keeps the tokens whose surprisal is nearest the entropy: with one
    likely token beside a flat tail, that is the tail, and min_p then counts from its best."""
    logits = np.zeros(VOCAB)
    logits[7] = 4.0
    logits[:5] = [1.0, 0.9, 0.8, 0.7, 0.6]
    want = reference_distribution(logits, typical_p=0.3)
    assert want[7] == 0 and want.sum() == pytest.approx(1.0)
    params = SamplingParams(do_sample=True, seed=3, typical_p=0.3)
    assert 7 not in set(draw_from_logits(params, logits, 500)) | set(draw(params, logits, 500))


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(do_sample=True, seed=4, top_k=20, min_p=0.1),
        SamplingParams(do_sample=True, seed=4, top_k=50, typical_p=0.6, repetition_penalty=1.4),
        SamplingParams(do_sample=True, seed=4, top_k=30, top_p=0.8, min_p=0.05, typical_p=0.9),
    ],
)
def test_a_rows_tokens_do_not_depend_on_the_candidates_its_batch_brings(params):
    """Batch invariance: a batch's top-k graph returns as many candidates as its most demanding row
    needs (a bucket), so a row sees more candidates in a bigger batch than alone; and a row of the
    same sequence may draw from its whole logits row instead (logprobs asked). Each gives the same
    tokens from the same seed."""
    rng = np.random.default_rng(9)
    rows = rng.normal(0, 2, (12, VOCAB)).astype(np.float32)
    runs = []
    for extra in (0, 37, VOCAB):
        sampler = SlotSampler(params, [1, 2, 3], VOCAB)
        tokens = []
        for row in rows:
            values, ids = candidates(row)
            k = min(VOCAB, sampler.candidates_needed() + extra)
            tokens.append(sampler.choose(values[:k], ids[:k]))
        runs.append(tokens)
    whole = SlotSampler(params.model_copy(update={"logprobs": 2}), [1, 2, 3], VOCAB)
    runs.append([whole.choose_from_logits(row) for row in rows])
    assert all(run == runs[0] for run in runs) and len(set(runs[0])) > 1


@pytest.mark.parametrize(
    "field, value", [("min_p", -0.01), ("min_p", 1.01), ("typical_p", 0.0), ("typical_p", 1.5)]
)
def test_min_p_and_typical_p_past_their_bounds_are_refused(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_min_p_and_typical_p_survive_the_pd_state():
    params = SamplingParams(do_sample=True, seed=2, min_p=0.2, typical_p=0.7)
    state = SlotSampler(params, [], VOCAB).state()
    assert SlotSampler.from_state(state, VOCAB).params == params


@pytest.mark.parametrize(
    "body, refused",
    [
        ({"mirostat": 2, "mirostat_tau": 5.0}, ["mirostat", "mirostat_tau"]),
        ({"mirostat": 0, "mirostat_tau": 5.0, "mirostat_eta": 0.1}, []),  # off: asks nothing
        ({"dry_multiplier": 0.8, "dry_base": 1.75}, ["dry_multiplier", "dry_base"]),
        ({"dry_multiplier": 0, "dry_sequence_breakers": ["\n"]}, []),
        ({"xtc_probability": 0.5}, ["xtc_probability"]),
        ({"tfs_z": 1.0, "top_a": 0, "typical_p": 0.5}, []),
        ({"tfs_z": 0.9}, ["tfs_z"]),
        ({"top_n_sigma": -1}, []),
        ({"top_n_sigma": 1.5}, ["top_n_sigma"]),
        ({"repeat_last_n": 64}, []),  # no penalty to window
        ({"repeat_last_n": 64, "repetition_penalty": 1.1}, ["repeat_last_n"]),
        ({"use_beam_search": True, "length_penalty": 0.5}, ["use_beam_search", "length_penalty"]),
        ({"best_of": 1, "user": "someone", "metadata": {"a": 1}}, []),  # other fields: not sampling
        ({"best_of": 3, "n_probs": 2}, ["best_of", "n_probs"]),
        (
            {"penalty_alpha": 0.6, "eta_cutoff": 3e-4, "epsilon_cutoff": 3e-4},
            ["penalty_alpha", "eta_cutoff", "epsilon_cutoff"],
        ),
        ({"dynatemp_range": 0.5, "dynatemp_exponent": 1}, ["dynatemp_range", "dynatemp_exponent"]),
        ({"penalize_nl": True}, ["penalize_nl"]),
    ],
)
def test_sampling_parameters_no_sampler_implements_are_named_unless_off(body, refused):
    problem = unserved_sampling(body)
    if not refused:
        assert problem is None
    else:
        assert problem is not None and all(name in problem for name in refused), problem
        assert "not supported" in problem


def test_names_an_api_takes_itself_are_not_refused_as_unserved():
    assert unserved_sampling({"best_of": 2}, served={"best_of"}) is None


def test_the_server_readme_names_every_refused_sampling_parameter():
    """Docs that cannot drift: the README's sampling section lists what the server refuses."""
    readme = (Path(__file__).parents[3] / "server" / "README.md").read_text()
    section = readme.split("### Sampling parameters", 1)[1].split("\n### ", 1)[0]
    missing = [n for n in [*UNSERVED_SAMPLING, *UNSERVED_SETTINGS] if f"`{n}`" not in section]
    assert not missing, missing
