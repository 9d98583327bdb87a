"""The graphs' logits under runtime.activations int8 against the numpy reference that rounds each
integer-format product's input as the kernels do (reference_numpy.forward int8), aware of rounding
ties: where the reference meets a value within a few ulps of a half step (reference_numpy.TIE_ULPS),
a float32 input summed in another order may round the other way, which moves the logits by up to
about half of all the rounding's effect, and the KV written then carries it on; the LM head's input,
rounded too, then meets other ties of its own. So from a sequence's first tie in a layer on, its calls
are only held within the rounding's own reach: no farther from the int8 reference than twice the
distance between it and the float one (wrong rows or garbage are far beyond). A tie in the LM head's
input alone moves only that call's logits: each logit is allowed the move of rounding them the other
way (reference_numpy.forward head_slack), and the call stays exact."""

from dataclasses import dataclass, field

import numpy as np

import reference_numpy as ref


@dataclass
class Int8Comparison:
    reference: ref.RefModel
    # (distance to the int8 reference, distance to the float one) of each call checked
    exact: list[tuple[float, float]] = field(default_factory=list)  # before its sequence's first tie
    tied: list[tuple[float, float]] = field(default_factory=list)  # from it on

    def check(self, got: np.ndarray, tokens: list[int], cache: ref.RefCache, near_ties: list[int]) -> int:
        """The call's last logits `got` (tokens after `cache`, which the int8 reference then extends;
        near_ties: the sequence's ties so far, extended too); returns the reference's greedy token."""
        before = ref.RefCache([list(k) for k in cache.keys], [list(v) for v in cache.values])
        slack: list[np.ndarray] = []
        want = ref.forward(self.reference, tokens, cache, int8=True, near_ties=near_ties, head_slack=slack)[
            -1
        ]
        floats = ref.forward(self.reference, tokens, before)[-1]
        beyond_slack = np.abs(got - want) - (slack[-1][-1] if slack else 0.0)
        distances = (float(np.maximum(beyond_slack, 0.0).max()), float(np.abs(got - floats).max()))
        (self.tied if sum(near_ties) else self.exact).append(distances)
        return int(np.argmax(want))

    def assert_agrees(self, tolerance: float, min_exact: int) -> None:
        """Tie-free calls within `tolerance` (at least min_exact of them), each far nearer to the int8
        reference than to the float one (the int8 path ran); tied calls within the rounding's reach."""
        exact, tied = self.exact, self.tied
        assert len(exact) >= min_exact, (exact, tied)
        assert max(d for d, _ in exact) < tolerance, exact
        assert min(off for _, off in exact) > 10 * max(d for d, _ in exact), exact
        assert all(d < 2 * off for d, off in tied), tied


@dataclass
class Int8Reach:
    """A deep model's int8 answers against the Q8_1 reference, where ties are too many to allow for
    one by one: the default model's 37-token chat prompt meets 227 in its reference forward. Each
    rounds either way by float32 ulps (the kernels' inputs against the reference's float64 ones), and
    over 30 layers they move the logits as far as int8 moves them from float32: the reference with
    every rounded input one ulp off moves by up to 1.2, int8 from float32 0.6-1.3. So which of two
    near-equal tokens wins (the France question's first: "L'" over "The" by 0.047 in the reference,
    "The" by 0.08 in float32) is the ulps' choice, not the arithmetic's, and a kernel on another CPU
    class picks either. Each call is held within that reach: the reference's own move under one ulp
    of jitter (or its distance from float32, if larger)."""

    reference: ref.RefModel
    jitter: np.random.Generator = field(default_factory=lambda: np.random.default_rng(0))
    int8: ref.RefCache = field(default_factory=ref.RefCache)
    jittered: ref.RefCache = field(default_factory=ref.RefCache)
    floats: ref.RefCache = field(default_factory=ref.RefCache)

    def check(self, got: np.ndarray, tokens: list[int]) -> int:
        """The call's last logits `got` (after `tokens`, which every reference cache then holds):
        int8 ran (far from float32, which agrees to 1e-3), within the reach of the reference, and
        its greedy token one the reference rates within that reach of its best; returns the token."""
        want = ref.forward(self.reference, tokens, self.int8, int8=True)[-1]
        moved = ref.forward(self.reference, tokens, self.jittered, int8=True, ulp_jitter=self.jitter)[-1]
        floats = ref.forward(self.reference, tokens, self.floats)[-1]
        reach = max(float(np.abs(moved - want).max()), float(np.abs(floats - want).max()))
        token = int(np.argmax(got))
        assert np.abs(got - floats).max() > 1e-2, "the call ran float32 products, not int8"
        assert np.abs(got - want).max() < 2 * reach, (np.abs(got - want).max(), reach)
        assert want.max() - want[token] <= reach, (
            token,
            int(np.argmax(want)),
            want.max() - want[token],
            reach,
        )
        return token
