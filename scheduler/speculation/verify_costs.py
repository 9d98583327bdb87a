"""VerifyCosts: what proposed tokens add to a group's decode step, learned from the steps' round
trips as the scheduler waits for them: the agent's compute and what every step adds around it
(ZeroMQ, (de)serialising), since a step's tokens cost all of it (the proposal lengths' costs:
scheduler/speculation/proposal_length.py).

Decode steps, with or without proposals to verify (and no prompt chunk: those are StepCosts'),
are samples of one linear model,

    seconds = a + b * decode rows + (steps that verify) fixed + m * proposed tokens

fitted by least squares over moving averages, so it follows the machine and the batch. A step
that verifies runs the mixed graph instead of the decode graph: `fixed` is that switch's cost, `m`
a proposed token's. Terms the samples cannot tell apart (one batch size, one proposal length)
are pulled slightly towards zero, the time going to the intercept and to `fixed`: what the samples
did show is still predicted right. Until a plain decode step and one that verifies were seen, the
costs are unknown (None). Costs learned while proposals did not pay would stop them for good (no
step verifies, none measures again): after PROBE_EVERY decode steps without one, the proposal
lengths are chosen as if unknown until a step verifies (scheduler/speculation/proposal_length.py).

    costs = VerifyCosts()
    costs.sampled(rows=1, proposed=0, seconds=0.020)
    costs.sampled(rows=1, proposed=4, seconds=0.023)
    costs.decode_s(rows=1), costs.fixed_s, costs.token_s    # ~0.020; 0.003 between them
"""

from __future__ import annotations

from scheduler.step_costs import solve_linear

_TIE_BREAK = (1e-9, 1e-6, 1e-6, 1e-6)  # a, b, fixed, m: see above
_TERMS = 4
PROBE_EVERY = 64  # decode steps: a probe costs at most `fixed` once in 64 steps


class VerifyCosts:
    def __init__(self, smoothing: float = 0.05):
        """smoothing: the weight of the newest step in the averages."""
        self.smoothing = smoothing
        # averages of x x^T and x * seconds, x = (1, rows, verifies, proposed): plain floats, as
        # StepCosts (no BLAS threads waking in the server)
        self._xx = [[0.0] * _TERMS for _ in range(_TERMS)]
        self._xt = [0.0] * _TERMS
        self._seen = [False, False]  # a plain decode step, one that verifies
        self._model: list[float] | None = None
        self.unverified = 0  # decode steps since the last that verified

    def sampled(self, rows: int, proposed: int, seconds: float) -> None:
        """A decode step of `rows` rows and `proposed` tokens to verify after them took `seconds`."""
        if seconds <= 0 or rows <= 0:  # the agent timed nothing
            return
        x = [1.0, float(rows), float(proposed > 0), float(proposed)]
        weight = self.smoothing if any(self._seen) else 1.0
        for i, row in enumerate(self._xx):
            for j in range(_TERMS):
                row[j] += weight * (x[i] * x[j] - row[j])
            self._xt[i] += weight * (x[i] * seconds - self._xt[i])
        self._seen[proposed > 0] = True
        self._model = self._fit() if all(self._seen) else None
        self.unverified = 0 if proposed else self.unverified + 1

    def _fit(self) -> list[float]:
        """The least-squares terms; where noise makes the switch or a token cost less than nothing,
        the fit without that term (its time then goes to the others), not a clamped one."""
        terms = list(range(_TERMS))
        while True:
            model = self._solve(terms)
            negative = [i for i in (2, 3) if i in terms and model[i] < 0]
            if not negative:
                return model
            terms.remove(min(negative, key=lambda i: model[i]))

    def _solve(self, terms: list[int]) -> list[float]:
        scale = [max(self._xx[i][i], 1e-12) ** 0.5 for i in terms]  # the terms in like units
        normal = [
            [
                self._xx[i][j] / (scale[a] * scale[b]) + (_TIE_BREAK[i] if i == j else 0.0)
                for b, j in enumerate(terms)
            ]
            for a, i in enumerate(terms)
        ]
        solved = solve_linear(normal, [self._xt[i] / scale[a] for a, i in enumerate(terms)])
        model = [0.0] * _TERMS
        for a, i in enumerate(terms):
            model[i] = solved[a] / scale[a]
        return model

    @property
    def probe_due(self) -> bool:
        """Whether the group went PROBE_EVERY decode steps without verifying: what its proposals
        cost is to be measured again (it may have been learned on slow steps)."""
        return self.unverified >= PROBE_EVERY

    @property
    def known(self) -> bool:
        return self._model is not None

    def decode_s(self, rows: int) -> float | None:
        """A decode step's seconds without proposals, as fitted; None while unknown."""
        if self._model is None:
            return None
        a, b = self._model[:2]
        return a + b * rows

    @property
    def fixed_s(self) -> float:
        """Seconds a step's proposals add once, whatever their number (0 while unknown)."""
        return 0.0 if self._model is None else max(self._model[2], 0.0)

    @property
    def token_s(self) -> float:
        """Seconds one proposed token adds (0 while unknown)."""
        return 0.0 if self._model is None else max(self._model[3], 0.0)
