"""StepCosts: how many prompt positions one group's step may carry beside its decode rows.

A prompt chunk in the same step as the decode rows delays every stream's next token by its cost.
The token budget alone (server.max_num_batched_tokens) cannot bound that delay: what a prompt
position costs against a decode row depends on the model, the machine and the batch. So the step
is bounded in time instead: while sequences decode, a step that also computes prompt positions
takes at most `stall_ratio` times a decode step alone, which keeps a stream's slowest token a
bounded multiple of its usual one (ITL p99 against p50) while prompts still advance every step.

Both costs are learned from the agent's own compute times as the group runs (an exponential
moving average, so they follow the batch as it grows and shrinks): a decode step's time, and a
prompt position's extra time in a mixed step. Until both are known the budget alone decides.

    costs = StepCosts(stall_ratio=1.75, floor=16)
    costs.decoded(0.030)                 # a decode step of the group took 30 ms
    costs.mixed(prompt_positions=40, seconds=0.064)
    costs.prompt_positions()             # -> 26: (1.75 - 1) * 30 ms / 0.85 ms, at least `floor`
"""

from __future__ import annotations


class StepCosts:
    def __init__(self, stall_ratio: float, floor: int, smoothing: float = 0.2):
        """stall_ratio: a mixed step's time over a decode step's (0: no bound); floor: prompt
        positions a step may always carry, however slow they are (prompts never stop advancing)."""
        self.stall_ratio = stall_ratio
        self.floor = floor
        self.smoothing = smoothing
        self.decode_s: float | None = None  # a decode step's time
        self.position_s: float | None = None  # a prompt position's extra time in a mixed step

    def _average(self, old: float | None, new: float) -> float:
        return new if old is None else old + self.smoothing * (new - old)

    def decoded(self, seconds: float) -> None:
        """A decode step (no prompt positions) took `seconds` in the agent."""
        if seconds > 0:
            self.decode_s = self._average(self.decode_s, seconds)

    def mixed(self, prompt_positions: int, seconds: float) -> None:
        """A step of decode rows and `prompt_positions` prompt positions took `seconds`."""
        if self.decode_s is None or prompt_positions <= 0 or seconds <= self.decode_s:
            return
        self.position_s = self._average(self.position_s, (seconds - self.decode_s) / prompt_positions)

    def prompt_positions(self) -> int | None:
        """Prompt positions a step with decode rows may carry; None while unknown or unbounded."""
        if not self.stall_ratio or self.decode_s is None or self.position_s is None:
            return None
        return max(self.floor, int((self.stall_ratio - 1) * self.decode_s / self.position_s))
