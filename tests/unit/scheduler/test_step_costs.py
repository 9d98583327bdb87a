"""StepCosts: the prompt positions a step may carry beside its decode rows, learned from step times."""

import itertools

import pytest

from scheduler.step_costs import DECODE_STEP_EVERY, StepCosts


def step_s(rows: int, attended: int, chunks=()) -> float:
    """A made-up machine: 8 ms a step, 1.2 ms a decode row, 2 us a position it attends; a mixed step
    2 ms more, 0.7 ms a prompt position, 1 us a (position, earlier position) pair."""
    seconds = 0.008 + 0.0012 * rows + 2e-6 * attended
    if chunks:
        pairs = sum((end - start) * start + (end - start) * (end - start + 1) // 2 for start, end in chunks)
        seconds += 0.002 + 0.0007 * sum(end - start for start, end in chunks) + 1e-6 * pairs
    return seconds


def positions_within(stall: float, start: int) -> int:
    """The most positions from `start` on whose extra time on the made-up machine (the mixed graph's
    included) stays within `stall`."""
    return max(n for n in range(1, 2000) if step_s(0, 0, [(start, start + n)]) - step_s(0, 0) <= stall)


def test_nothing_is_bounded_until_a_decode_and_a_mixed_step_are_known():
    costs = StepCosts(stall_ratio=1.75, floor=16)
    assert costs.prompt_positions(8, 800) is None
    costs.mixed(8, 800, [(0, 40)], 0.064)  # no decode step seen yet: nothing to compare it with
    assert costs.prompt_positions(8, 800) is None
    costs.decoded(8, 800, 0.030)
    # one of each: the 34 ms more of the mixed step all count per position (0.85 ms each)
    assert costs.prompt_positions(8, 800) == pytest.approx(0.75 * 0.030 / (0.034 / 40), abs=1)  # 26


def test_the_floor_keeps_prompts_moving_and_ratio_zero_bounds_nothing():
    slow = StepCosts(stall_ratio=1.5, floor=16)
    slow.decoded(4, 400, 0.010)
    slow.mixed(4, 400, [(0, 10)], 0.110)  # 10 ms a position: half a decode step allows 0 positions
    assert slow.prompt_positions(4, 400) == 16
    off = StepCosts(stall_ratio=0, floor=16)
    off.decoded(4, 400, 0.030)
    off.mixed(4, 400, [(0, 40)], 0.064)
    assert off.prompt_positions(4, 400) is None


def test_the_fit_tells_the_batch_the_mixed_graph_the_positions_and_their_context_apart():
    costs = StepCosts(stall_ratio=1.75, floor=1)
    sizes = itertools.cycle([8, 32, 16, 4, 24])
    for i in range(200):
        rows = 4 + i * 7 % 29
        attended = rows * (20 + i * 37 % 300)
        if i % 3:
            costs.decoded(rows, attended, step_s(rows, attended))
        else:
            start = i * 53 % 700
            chunk = [(start, start + next(sizes))]
            costs.mixed(rows, attended, chunk, step_s(rows, attended, chunk))
    assert costs.decode_s(16, 2400) == pytest.approx(step_s(16, 2400), rel=0.01)
    assert costs.decode_s(64, 64 * 500) == pytest.approx(step_s(64, 64 * 500), rel=0.01)  # beyond those seen
    stall = 0.75 * step_s(16, 2400)
    assert costs.prompt_positions(16, 2400) == pytest.approx(positions_within(stall, 0), abs=1)
    # a later chunk of a long prompt attends to more: fewer of its positions fit
    late = costs.prompt_positions(16, 2400, start=800)
    assert late == pytest.approx(positions_within(stall, 800), abs=1) and late < positions_within(stall, 0)
    costs.decoded(16, 2400, 0.0)  # a step the agent timed as nothing changes nothing
    assert costs.prompt_positions(16, 2400, start=800) == late


def test_a_burst_of_mixed_steps_under_a_growing_batch_is_not_charged_to_its_prompts():
    # Warm-up decodes one row; then every step is mixed while the batch grows (a burst of prompts):
    # the time the new rows add is not the prompt positions' (it would leave only the floor).
    costs = StepCosts(stall_ratio=1.75, floor=16)
    for length in range(20, 40):
        costs.decoded(1, length, step_s(1, length))
    for rows in range(4, 40):
        chunk = [(0, (16, 48, 24, 64)[rows % 4])]
        costs.mixed(rows, rows * 30, chunk, step_s(rows, rows * 30, chunk))
    assert costs.decode_s(40, 1200) == pytest.approx(step_s(40, 1200), rel=0.05)
    stall = 0.75 * step_s(40, 1200)
    assert costs.prompt_positions(40, 1200) == pytest.approx(positions_within(stall, 0), rel=0.05)


def test_the_stall_allowed_grows_with_the_prompts_waiting_per_stream():
    costs = StepCosts(stall_ratio=1.75, floor=16)
    costs.decoded(8, 800, 0.030)
    costs.mixed(8, 800, [(0, 40)], 0.064)
    alone = costs.prompt_positions(8, 800)
    per_position = 0.034 / 40
    assert costs.prompt_positions(16, 800, waiting=1) == pytest.approx(
        0.75 * 0.030 * (1 + 1 / 16) / per_position, abs=1
    )
    assert costs.prompt_positions(8, 800, waiting=8) == pytest.approx(2 * alone, abs=2)
    # (one chunk size seen: a sliver of its cost may go to the context term, which weighs at 400)
    assert costs.prompt_positions(4, 800, waiting=60) == pytest.approx(
        16 * 0.75 * 0.030 / per_position, rel=0.02
    )


def test_a_refit_that_makes_positions_look_free_keeps_the_last_bound():
    """One slow step with few positions can tip the fit into a free (or negative) position cost: the
    bound stays the last fit's, not none (an unbounded step would stall every stream)."""
    costs = StepCosts(stall_ratio=1.5, floor=1)
    costs.decoded(16, 1600, 0.030)
    costs.mixed(16, 1600, [(0, 10)], 0.040)  # 1 ms a position: 15 positions in half a decode step
    bound = costs.prompt_positions(16, 1600)
    assert bound == pytest.approx(15, abs=1)
    costs.mixed(16, 1600, [(0, 60)], 0.020)  # noise: a step with more positions, faster than a decode
    assert costs._fit() is None and costs.prompt_positions(16, 1600) == bound


def test_a_decode_step_alone_is_wanted_until_seen_and_again_after_many_mixed_ones():
    costs = StepCosts(stall_ratio=1.5, floor=1)
    assert costs.wants_decode_step
    costs.decoded(16, 1600, 0.030)
    for _ in range(DECODE_STEP_EVERY - 1):
        costs.mixed(16, 1600, [(0, 10)], 0.040)
        assert not costs.wants_decode_step
    costs.mixed(16, 1600, [(0, 10)], 0.040)
    assert costs.wants_decode_step
    costs.decoded(16, 1600, 0.030)
    assert not costs.wants_decode_step


def test_batch_work_takes_its_own_ratio_and_floor():
    costs = StepCosts(stall_ratio=1.5, floor=16)
    costs.decoded(16, 1600, 0.030)
    costs.mixed(16, 1600, [(0, 10)], 0.040)  # 1 ms a position
    assert costs.prompt_positions(16, 1600) == pytest.approx(15, abs=1)
    assert costs.prompt_positions(16, 1600, ratio=1.2, floor=1) == pytest.approx(6, abs=1)
    costs.mixed(16, 1600, [(0, 10)], 0.330)  # 30 ms a position now: nothing fits, the floor holds
    assert costs.prompt_positions(16, 1600, ratio=1.2, floor=1) == 1
    off = StepCosts(stall_ratio=0, floor=16)  # streams' prompts unbounded: batch work still is
    off.decoded(16, 1600, 0.030)
    off.mixed(16, 1600, [(0, 10)], 0.040)
    assert off.prompt_positions(16, 1600) is None
    assert off.prompt_positions(16, 1600, ratio=1.2, floor=1) == pytest.approx(6, abs=1)
