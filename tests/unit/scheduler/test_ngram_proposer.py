"""Speculative decoding's proposer: the n-gram index against a brute-force lookup, and the backoff
of a sequence whose proposals keep failing."""

from hypothesis import given
from hypothesis import strategies as st

from agent.contract.sampling import SamplingParams
from config.schema import SpeculationSection
from scheduler.ngram import NgramIndex
from scheduler.sequence import Sequence
from scheduler.speculation import MAX_SKIP, Speculator


def brute_force(tokens: list[int], n_min: int, n_max: int, k: int) -> list[int]:
    """What followed the latest earlier occurrence of the longest tail n-gram, by scanning."""
    for n in range(min(n_max, len(tokens) - 1), n_min - 1, -1):
        tail = tokens[-n:]
        for end in range(len(tokens) - 1, n - 1, -1):
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
    n_min, n_max = n_range[0], n_range[0] + n_range[1]
    index = NgramIndex(n_min, n_max)
    for end in sorted({*cuts, len(tokens)}):
        known = tokens[: min(end, len(tokens))]
        index.update(known)
        assert index.propose(known, k) == brute_force(known, n_min, n_max, k), known


def test_a_sequence_whose_proposals_fail_proposes_ever_less_often_until_one_is_kept():
    speculator = Speculator(SpeculationSection(method="ngram", ngram_min=1, ngram_max=2))
    seq = Sequence("r", [1, 2, 1, 2, 1], SamplingParams(), 100, frozenset())
    seq.output = [2]
    assert speculator.propose(seq, 3) == [1, 2]
    skips = []
    for _ in range(7):
        speculator.verified(seq, 3, 0)
        skipped = 0
        while not speculator.propose(seq, 3):
            skipped += 1
        skips.append(skipped)
    assert skips == [1, 2, 4, 8, 16, MAX_SKIP, MAX_SKIP]
    speculator.verified(seq, 3, 1)  # one kept: it proposes at once again
    assert speculator.propose(seq, 3) == [1, 2] and seq.speculation.kept == 1
    assert seq.speculation.proposed == 3 * 8
