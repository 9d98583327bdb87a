"""StepCosts: the prompt positions a step may carry beside its decode rows, learned from step times."""

import pytest

from scheduler.step_costs import StepCosts

pytestmark = pytest.mark.unit


def test_nothing_is_bounded_until_both_costs_are_known():
    costs = StepCosts(stall_ratio=1.75, floor=16)
    assert costs.prompt_positions() is None
    costs.mixed(40, 0.064)  # no decode step seen yet: nothing to compare it with
    assert costs.prompt_positions() is None
    costs.decoded(0.030)
    assert costs.prompt_positions() is None
    costs.mixed(40, 0.064)  # 34 ms more for 40 positions: 0.85 ms each
    assert costs.prompt_positions() == int(0.75 * 0.030 / (0.034 / 40))  # 26


def test_the_floor_keeps_prompts_moving_and_ratio_zero_bounds_nothing():
    slow = StepCosts(stall_ratio=1.5, floor=16)
    slow.decoded(0.010)
    slow.mixed(10, 0.110)  # 10 ms a position: half a decode step allows 0 positions
    assert slow.prompt_positions() == 16
    off = StepCosts(stall_ratio=0, floor=16)
    off.decoded(0.030)
    off.mixed(40, 0.064)
    assert off.prompt_positions() is None


def test_the_costs_follow_a_growing_batch_and_ignore_a_mixed_step_faster_than_a_decode():
    costs = StepCosts(stall_ratio=2.0, floor=1)
    costs.decoded(0.030)
    costs.mixed(30, 0.060)  # 1 ms a position: 30 positions double a 30 ms step
    assert costs.prompt_positions() == 30
    costs.mixed(30, 0.020)  # noise: faster than the decode step alone
    assert costs.prompt_positions() == 30
    for _ in range(40):  # the batch grew: decode steps take 60 ms now
        costs.decoded(0.060)
    assert costs.prompt_positions() == pytest.approx(60, abs=1)
