"""Speculative decoding's proposer: the n-gram index against a brute-force lookup, its bounded work
and memory on a long prompt, and the backoff of a sequence whose proposals keep failing."""

import random

from hypothesis import given
from hypothesis import strategies as st

from agent.contract.sampling import SamplingParams
from config.schema import SpeculationSection
from scheduler.sequence import Sequence
from scheduler.speculation.ngram import STEP_ENDS, WINDOW, NgramIndex
from scheduler.speculation.speculator import MAX_SKIP, Speculator


def brute_force(tokens: list[int], n_min: int, n_max: int, k: int, first_end: int = 0) -> list[int]:
    """What followed the latest earlier occurrence (ending at first_end or later) of the longest
    tail n-gram, by scanning."""
    for n in range(min(n_max, len(tokens) - 1), n_min - 1, -1):
        tail = tokens[-n:]
        for end in range(len(tokens) - 1, max(n, first_end) - 1, -1):
            if tokens[end - n : end] == tail:
                return tokens[end : end + k]
    return []


@given(
    tokens=st.lists(st.integers(0, 3), max_size=60),
    cuts=st.lists(st.integers(0, 60), max_size=5),
    n_range=st.tuples(st.integers(1, 3), st.integers(0, 3)),
    k=st.integers(1, 6),
)
def test_the_index_proposes_what_a_scan_finds_as_tokens_arrive(tokens, cuts, n_range, k):
    """With room for the whole sequence at once: the proposals of the index built at once."""
    n_min, n_max = n_range[0], n_range[0] + n_range[1]
    index = NgramIndex(n_min, n_max)
    for end in sorted({*cuts, len(tokens)}):
        known = tokens[: min(end, len(tokens))]
        index.update(known)
        assert index.propose(known, k) == brute_force(known, n_min, n_max, k), known


@given(
    tokens=st.lists(st.integers(0, 3), min_size=1, max_size=80),
    arrivals=st.lists(st.integers(1, 5), max_size=30),
    n_range=st.tuples(st.integers(1, 3), st.integers(0, 3)),
    bounds=st.tuples(st.integers(1, 6), st.integers(1, 40)),
)
def test_a_bounded_index_proposes_what_a_scan_of_its_latest_ends_finds(tokens, arrivals, n_range, bounds):
    """A few ends an update and a window: the proposals are the scan's over the ends indexed so
    far (the latest first), those of the whole window once caught up; it never holds more."""
    n_min, n_max = n_range[0], n_range[0] + n_range[1]
    step_ends, window = bounds
    index = NgramIndex(n_min, n_max, window=window, step_ends=step_ends)
    known = tokens[: max(1, len(tokens) - sum(arrivals))]
    for arrived in [0, *arrivals, *[0] * (80 // step_ends + 1)]:
        known = tokens[: len(known) + arrived]
        index.update(known)
        assert index.propose(known, 3) == brute_force(known, n_min, n_max, 3, index.lo), (known, index.lo)
        assert len(index.ends) <= window * (n_max - n_min + 1)
    assert index.lo == max(n_min, len(known) - window)
    assert index.propose(known, 3) == brute_force(known, n_min, n_max, 3, len(known) - window)


class CountingDict(dict):
    """The index's n-gram table, counting what is written to it."""

    writes = 0

    def __setitem__(self, key, value):
        self.writes += 1
        super().__setitem__(key, value)

    def setdefault(self, key, value=None):
        self.writes += 1
        return super().setdefault(key, value)


def test_a_long_prompt_is_indexed_a_bounded_number_of_ends_a_step():
    """A 32k-token prompt: its first proposal indexed every end (~100k n-grams, ~15 MB) on the
    scheduler loop; now each update writes at most STEP_ENDS ends' n-grams besides the new
    tokens', the table never holds more than WINDOW ends', and once caught up the proposals are
    those of a scan of the window."""
    draw = random.Random(0)
    prompt = [draw.randrange(100, 30_000) for _ in range(32_768)]  # chance repeats: a few 1-grams
    prompt[-600:-597] = prompt[-3:] = [1, 2, 3]  # the tail, and an earlier occurrence in the window
    prompt[100:103] = [4, 5, 6]  # an n-gram older than the window
    index, n_grams = NgramIndex(2, 4, ends=CountingDict()), 3
    tokens, updates = list(prompt), 0
    while True:
        before = index.ends.writes
        index.update(tokens)
        updates += 1
        assert index.ends.writes - before <= (STEP_ENDS + 1) * n_grams
        assert len(index.ends) <= WINDOW * n_grams
        if index.lo == len(tokens) - WINDOW:
            break
        tokens += index.propose(tokens, 1) or [7]
    assert updates == -(-WINDOW // STEP_ENDS)
    assert index.propose(tokens, 4) == brute_force(tokens, 2, 4, 4, len(tokens) - WINDOW)
    assert index.propose(tokens[:-2] + [4, 5], 2) == []  # a match older than the window is not held


def test_the_speculator_indexes_a_long_prompt_over_its_steps():
    speculator = Speculator(SpeculationSection(method="ngram", ngram_min=2, ngram_max=4))
    prompt = [1, 2, 3, 9] + list(range(10, 10 + 40_000)) + [1, 2, 3]
    seq = Sequence("r", prompt, SamplingParams(), 100, frozenset())
    assert speculator.propose(seq, 2) == []  # the match is 40,000 tokens back: not indexed yet
    index = seq.speculation.index
    assert index.hi - index.lo == STEP_ENDS


def test_a_sequence_whose_proposals_fail_proposes_ever_less_often_until_one_is_kept():
    speculator = Speculator(SpeculationSection(method="ngram", ngram_min=1, ngram_max=2))
    seq = Sequence("r", [1, 2, 1, 2, 1], SamplingParams(), 100, frozenset())
    seq.output = [2]
    assert speculator.propose(seq, 3) == [1, 2]
    skips = []
    for _ in range(7):
        speculator.verified(seq, 3, 0)
        skipped = 0
        while speculator.rests(seq):
            skipped += 1
        skips.append(skipped)
    assert skips == [1, 2, 4, 8, 16, MAX_SKIP, MAX_SKIP]
    speculator.verified(seq, 3, 1)  # one kept: it proposes at once again
    assert not speculator.rests(seq) and seq.speculation.kept == 1
    assert speculator.propose(seq, 3) == [1, 2]
    assert seq.speculation.proposed == 3 * 8
