"""StepCosts: how many prompt positions one group's step may carry beside its decode rows.

A prompt chunk in the same step as the decode rows delays every stream's next token by its cost.
The token budget alone (scheduler.max_num_batched_tokens) cannot bound that delay: what a prompt
position costs against a decode row depends on the model, the machine, the batch and how far into
its prompt the chunk is. So the step is bounded in time instead: while sequences decode, a step
that also computes prompt positions takes at most `stall_ratio` times a decode step alone, which
keeps a stream's slowest token a bounded multiple of its usual one (ITL p99 against p50) while
prompts still advance every step.

That bound is for the streams; the prompts waiting for their first token wait too. When many wait
per decoding stream (a burst of arrivals), the extra time a step may take grows with them: each
waiting prompt weighs as much as a stream, so a burst is admitted in a few steps and grows the
batch, instead of trickling in beside it for seconds.

The costs are learned from the agent's own compute times as the group runs: every step, decode or
mixed, is a sample of one linear model of the work in it,

    seconds = a + b * decode rows + g * positions they attend
                + (mixed steps) fixed + c * prompt positions + e * (position, earlier position) pairs

fitted by least squares over moving averages (recent steps weigh most, so it follows the machine).
A burst has mixed steps only, with the batch growing under them, and a long prompt's later chunks
attend to more: the model still tells each part's share. Until a decode step and a mixed step were
seen the budget alone decides. Work that can wait a step (an embedding job's inputs) waits one now
and then while `wants_decode_step`: where every step is mixed (streams beside a long job), a decode
step alone is what tells the streams' own cost from the job's.

An embedding job's inputs never decode: they are batch work beside the streams, bounded by a ratio
of their own (`ratio=`, scheduler.pooling_stall_ratio), so that the streams keep a set share of
their speed however long the job runs.

    costs = StepCosts(stall_ratio=1.75, floor=16)
    costs.decoded(rows=8, attended=800, seconds=0.030)
    costs.mixed(rows=8, attended=808, chunks=[(0, 40)], seconds=0.064)
    costs.prompt_positions(decodes=8, attended=816)             # ~26 positions at the start of a prompt
    costs.prompt_positions(decodes=8, attended=816, waiting=8)  # ~52: twice the stall while 8 wait
"""

from __future__ import annotations

import math
from collections.abc import Sequence

_K = 1024.0  # attended positions and pairs are counted in thousands: terms of like size
# Terms the samples may not tell apart (one batch size seen, batches of one context, mixed steps
# only) get this slight pull towards zero, so the time goes to the intercept and to the prompt
# positions: a position then costs the whole extra time over its count.
_TIE_BREAK = (1e-9, 1e-6, 1e-6, 1e-6, 1e-9, 1e-6)
# Mixed steps in a row after which a decode step alone is wanted (the averages' memory is ~1 / smoothing
# samples: a decode step's weight is still well above the tie-break after this many)
DECODE_STEP_EVERY = 64


class StepCosts:
    def __init__(self, stall_ratio: float, floor: int, smoothing: float = 0.05):
        """stall_ratio: a mixed step's time over a decode step's (0: no bound); floor: prompt
        positions a step may always carry, however slow they are (prompts never stop advancing);
        smoothing: the weight of the newest step in the averages."""
        self.stall_ratio = stall_ratio
        self.floor = floor
        self.smoothing = smoothing
        # averages of x x^T and x * seconds, x = (1, rows, attended, mixed, positions, pairs); plain
        # floats: numpy's BLAS would wake its threads in the server, beside the agents' on the cores
        self._xx = [[0.0] * 6 for _ in range(6)]
        self._xt = [0.0] * 6
        self._seen = [False, False]  # a decode step, a mixed step
        self._mixed_in_a_row = 0  # mixed steps since the last decode step alone
        self._model: list[float] | None = None  # (a, b, g, fixed, c, e), refitted after each sample

    def decoded(self, rows: int, attended: int, seconds: float) -> None:
        """A decode step of `rows` rows attending to `attended` positions in all took `seconds`."""
        self._sample([1.0, rows, attended / _K, 0.0, 0.0, 0.0], seconds)

    def mixed(self, rows: int, attended: int, chunks: Sequence[tuple[int, int]], seconds: float) -> None:
        """A step of `rows` decode rows (attending to `attended` positions) and prompt `chunks`
        (positions [start, end) each) took `seconds`."""
        positions = sum(end - start for start, end in chunks)
        if positions > 0:
            pairs = sum(_pairs(start, end - start) for start, end in chunks)
            self._sample([1.0, rows, attended / _K, 1.0, positions, pairs / _K], seconds)

    def _sample(self, x: list[float], seconds: float) -> None:
        if seconds <= 0:  # the agent timed nothing
            return
        weight = self.smoothing if any(self._seen) else 1.0
        for i, row in enumerate(self._xx):
            for j in range(6):
                row[j] += weight * (x[i] * x[j] - row[j])
            self._xt[i] += weight * (x[i] * seconds - self._xt[i])
        self._seen[int(x[3])] = True
        self._mixed_in_a_row = self._mixed_in_a_row + 1 if x[3] else 0
        if all(self._seen):  # a refit where noise made a position look free keeps the last fit
            self._model = self._fit() or self._model

    def _fit(self) -> list[float] | None:
        scale = [math.sqrt(max(self._xx[i][i], 1e-12)) for i in range(6)]  # every term in like units
        normal = [
            [self._xx[i][j] / (scale[i] * scale[j]) + (_TIE_BREAK[i] if i == j else 0.0) for j in range(6)]
            for i in range(6)
        ]
        model = [m / s for m, s in zip(solve_linear(normal, [t / s for t, s in zip(self._xt, scale)]), scale)]
        return model if model[4] > 0 else None  # noise made a position look free: no model from it

    @property
    def wants_decode_step(self) -> bool:
        """Whether a decode step alone is due: never seen, or many mixed steps ago."""
        return not self._seen[0] or self._mixed_in_a_row >= DECODE_STEP_EVERY

    def decode_s(self, rows: int, attended: int) -> float | None:
        """A decode step's time, as fitted; None before a decode and a mixed step were seen."""
        if self._model is None:
            return None
        a, b, g = self._model[:3]
        return a + b * rows + g * attended / _K

    def prompt_positions(
        self,
        decodes: int,
        attended: int,
        waiting: int = 0,
        start: int = 0,
        ratio: float | None = None,
        floor: int | None = None,
    ) -> int | None:
        """Prompt positions a step of `decodes` decode rows (attending to `attended` positions) may
        carry, from position `start` of a prompt on, while `waiting` prompts wait for their first
        token; None while unknown or unbounded. `ratio` and `floor` in place of the stall ratio's
        and floor (batch work's own)."""
        ratio = self.stall_ratio if ratio is None else ratio
        step = self.decode_s(decodes, attended)
        if not ratio or step is None or step <= 0:
            return None
        fixed, c, e = self._model[3:]  # type: ignore[index]
        stall = (ratio - 1) * step * (1 + waiting / max(decodes, 1)) - max(fixed, 0.0)
        stall = max(stall, 0.0)
        # the most positions n with c * n + e * pairs(start, n) / K <= stall (pairs grow as n^2 / 2)
        quadratic, linear = max(e, 0.0) / (2 * _K), c + max(e, 0.0) * (start + 0.5) / _K
        if quadratic > 0:
            positions = (math.sqrt(linear * linear + 4 * quadratic * stall) - linear) / (2 * quadratic)
        else:
            positions = stall / linear
        least = self.floor if floor is None else floor
        return max(least, int(positions + 1e-6))  # the fit's rounding must not cost a position


def _pairs(start: int, size: int) -> int:
    """(position, earlier or same position) pairs a chunk of `size` positions from `start` attends."""
    return size * start + size * (size + 1) // 2


def solve_linear(matrix: list[list[float]], rhs: list[float]) -> list[float]:
    """x with matrix @ x = rhs, for a small symmetric positive definite matrix (Cholesky)."""
    n = len(rhs)
    low = [[0.0] * n for _ in range(n)]
    for i in range(n):
        for j in range(i + 1):
            total = matrix[i][j] - sum(low[i][k] * low[j][k] for k in range(j))
            low[i][j] = math.sqrt(max(total, 1e-300)) if i == j else total / low[j][j]
    y = [0.0] * n
    for i in range(n):
        y[i] = (rhs[i] - sum(low[i][k] * y[k] for k in range(i))) / low[i][i]
    x = [0.0] * n
    for i in reversed(range(n)):
        x[i] = (y[i] - sum(low[k][i] * x[k] for k in range(i + 1, n))) / low[i][i]
    return x
