"""A sequence's speculative-decoding state: the index its n-gram proposals come from and its record
of kept proposals (scheduler/speculation/speculator.py proposes with them)."""

from __future__ import annotations

from dataclasses import dataclass, field

# Bounds of one sequence's index: a 32k-token prompt indexed at once took ~100k inserts (~13 MB,
# ~0.1 s) on the scheduler loop at its first proposal.
STEP_ENDS = 512  # older ends indexed in one update (besides the new tokens'): ~2 ms a step at most
WINDOW = 16_384  # the latest ends held: ~7 MB at the default n-grams (2..4), ~140 bytes an n-gram


@dataclass
class NgramIndex:
    """Where each n-gram (n_min..n_max) of a sequence's tokens last ended, among the ends lo..hi-1
    (an n-gram's end: the index of the token after it; the last token's end is never recorded, the
    tail itself must find an earlier one). The tokens an update finds are indexed newest first: the
    new ones at once, the older ones (a long prompt's) at most `step_ends` an update, so a long
    prompt costs no step more than that and its latest occurrences are found first. Only the
    latest `window` ends are held: older ones are forgotten as tokens arrive."""

    n_min: int
    n_max: int
    window: int = WINDOW
    step_ends: int = STEP_ENDS
    ends: dict[tuple[int, ...], int] = field(default_factory=dict)
    lo: int = 0
    hi: int = 0  # 0: nothing indexed yet

    def update(self, tokens: list[int]) -> None:
        """Index the ends of the tokens that arrived since the last update, forget those that left
        the window, and index up to step_ends older ends."""
        if not self.hi:
            self.lo = self.hi = len(tokens)
        floor = max(self.n_min, len(tokens) - self.window)
        for end in range(max(self.hi, self.n_min), len(tokens)):
            self._record(tokens, end, newest=True)
        self.hi = max(self.hi, len(tokens))
        for end in range(self.lo, min(floor, self.hi)):
            self._forget(tokens, end)
        self.lo = max(self.lo, floor)
        older = max(floor, self.lo - self.step_ends)
        for end in range(self.lo - 1, older - 1, -1):
            self._record(tokens, end, newest=False)
        self.lo = older

    def _record(self, tokens: list[int], end: int, newest: bool) -> None:
        for n in range(self.n_min, min(self.n_max, end) + 1):
            gram = tuple(tokens[end - n : end])
            if newest:
                self.ends[gram] = end
            else:  # a later end of the same n-gram, already held, is the one to keep
                self.ends.setdefault(gram, end)

    def _forget(self, tokens: list[int], end: int) -> None:
        for n in range(self.n_min, min(self.n_max, end) + 1):
            gram = tuple(tokens[end - n : end])
            if self.ends.get(gram) == end:  # no later end of it is held
                del self.ends[gram]

    def propose(self, tokens: list[int], k: int) -> list[int]:
        """Up to k tokens that followed the latest indexed occurrence of the longest tail n-gram."""
        for n in range(min(self.n_max, len(tokens) - 1), self.n_min - 1, -1):
            end = self.ends.get(tuple(tokens[-n:]))
            if end is not None:
                return tokens[end : end + k]
        return []


@dataclass
class SpeculationState:
    """One sequence's proposals: its n-gram index, and its record of kept proposals."""

    index: NgramIndex
    tokens: list[int] = field(default_factory=list)  # prompt + output, extended as tokens arrive
    skip: int = 0  # steps left without proposals
    backoff: int = 1  # the skip after the next step that keeps none
    proposed: int = 0
    kept: int = 0
    # decayed counts of kept and missed proposed tokens: its acceptance (proposal_length.py)
    kept_weight: float = 0.0
    missed_weight: float = 0.0
