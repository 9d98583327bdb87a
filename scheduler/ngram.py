"""A sequence's speculative-decoding state: the index its n-gram proposals come from and its record
of kept proposals (scheduler/speculation.py proposes with them)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class NgramIndex:
    """Where each n-gram (n_min..n_max) of a sequence's tokens last ended, for the tokens before
    its last one (`indexed`: how many ends are recorded)."""

    n_min: int
    n_max: int
    ends: dict[tuple[int, ...], int] = field(default_factory=dict)
    indexed: int = 0

    def update(self, tokens: list[int]) -> None:
        """Record the n-grams ending before the last token (the tail itself must find an earlier one)."""
        for end in range(max(self.indexed, self.n_min), len(tokens)):
            for n in range(self.n_min, min(self.n_max, end) + 1):
                self.ends[tuple(tokens[end - n : end])] = end
        self.indexed = max(self.indexed, len(tokens))

    def propose(self, tokens: list[int], k: int) -> list[int]:
        """Up to k tokens that followed the latest earlier occurrence of the longest tail n-gram."""
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
