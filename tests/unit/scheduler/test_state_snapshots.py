"""State snapshots of a hybrid model's Gated DeltaNet layers (scheduler/state_snapshots.py): the
snapshot slots alone, then through the BatchScheduler against a fake agent that keeps each slot's
"state" as the token prefix it has taken in, and each snapshot slot's as the prefix it was saved
after. A chunk from a prefix-cache hit must restore a snapshot of exactly the prefix it starts
after; a chunk after position 0 without a restore goes on from its own slot's state (the agent's
rule, agent/step_checks.py); a wrong restore or a wrong save fails an assertion here."""

import copy
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_batch_scheduler import EOS, FakeAgent, answered, refused, sampled, seq

from agent.contract.sampling import Sampled
from agent.contract.step import StepRequest
from agent.contract.step_reply import StepReply
from scheduler.batch_scheduler import BatchScheduler
from scheduler.plan import Failure, GroupCapacity, StepOutcome
from scheduler.sequence import FinishReason
from scheduler.state_snapshots import StateSnapshots

SIZE = 16

# ------------------------------------------------------------------------------ the slots alone


def registered(snapshots: StateSnapshots, slot: int, serial: int) -> None:
    """Take `slot` (the next one take gives) and register a snapshot of `serial` in it."""
    assert snapshots.take() == slot
    snapshots.saved(slot, serial)


def untakeable(snapshots: StateSnapshots) -> set[int]:
    """The slots take() would never give away now (pinned or reserved), asked of a copy."""
    probe, given = copy.deepcopy(snapshots), set()
    while (slot := probe.take()) is not None:
        given.add(slot)
    return set(range(snapshots.slots)) - given


def test_a_snapshot_store_needs_a_slot():
    with pytest.raises(ValueError):
        StateSnapshots(0)


def test_usable_hit_is_the_longest_run_whose_last_block_has_a_snapshot():
    snapshots = StateSnapshots(3)
    registered(snapshots, 0, 11)
    registered(snapshots, 1, 13)
    assert snapshots.held == 2
    assert snapshots.usable_hit([10, 11, 12, 13, 14]) == (4, 1)
    assert snapshots.usable_hit([10, 11, 12]) == (2, 0)
    assert snapshots.usable_hit([11]) == (1, 0)
    assert snapshots.usable_hit([10, 12, 14]) == (0, None)
    assert snapshots.usable_hit([]) == (0, None)


def test_take_gives_free_slots_first_then_the_least_recently_used_snapshot():
    snapshots = StateSnapshots(3)
    for slot, serial in enumerate((101, 102, 103)):  # free ones, slot 0 first
        registered(snapshots, slot, serial)
    snapshots.pin(0)  # used: now the most recently
    snapshots.unpin(0)
    assert snapshots.take() == 1  # the least recently used: 102's
    assert snapshots.usable_hit([102]) == (0, None) and snapshots.held == 2
    assert snapshots.take() == 2  # then 103's (0 was used after it)
    assert snapshots.usable_hit([101]) == (1, 0) and snapshots.usable_hit([103]) == (0, None)


def test_a_pinned_or_reserved_slot_is_never_given_away():
    snapshots = StateSnapshots(2)
    registered(snapshots, 0, 7)
    snapshots.pin(0)
    snapshots.pin(0)  # two restores of it planned
    assert snapshots.take() == 1  # reserved for a save not yet done
    assert snapshots.take() is None
    assert untakeable(snapshots) == {0, 1}
    snapshots.unpin(0)
    assert snapshots.take() is None  # one restore still reads it
    snapshots.unpin(0)
    assert snapshots.take() == 0  # given away: its snapshot is forgotten
    assert snapshots.usable_hit([7]) == (0, None) and snapshots.held == 0
    assert snapshots.restored == 2


def test_saving_a_prefix_held_elsewhere_frees_the_older_slot_unless_it_is_pinned():
    snapshots = StateSnapshots(3)
    registered(snapshots, 0, 5)
    registered(snapshots, 1, 5)  # the same prefix again: 0 goes back
    assert snapshots.usable_hit([5]) == (1, 1) and snapshots.held == 1
    assert snapshots.take() == 0  # free again (not the never-used slot 2 first: a stack)
    snapshots.release(0)
    snapshots.pin(1)  # a restore reads 1: a new save of the same prefix is the spare one
    assert snapshots.take() == 0
    snapshots.saved(0, 5)
    assert snapshots.usable_hit([5]) == (1, 1) and snapshots.held == 1
    assert snapshots.take() == 0  # the spare went back to the free ones


def test_release_frees_a_reserved_slot_and_does_nothing_after_its_save():
    snapshots = StateSnapshots(2)
    slot = snapshots.take()
    assert slot == 0
    snapshots.release(slot)  # its step failed
    assert snapshots.take() == 0  # free again
    snapshots.saved(0, 9)
    snapshots.release(0)  # the outcome's sweep after the save: nothing changes
    assert snapshots.usable_hit([9]) == (1, 0) and snapshots.held == 1
    assert snapshots.take() == 1  # the free one, not the registered 0
    snapshots.release(1)
    snapshots.release(1)  # twice: still one free slot, not two
    assert snapshots.take() == 1
    assert snapshots.take() == 0  # evicts 9's: 1 was not listed free twice


def test_reset_forgets_every_snapshot_pin_and_reservation():
    snapshots = StateSnapshots(2)
    registered(snapshots, 0, 3)
    snapshots.pin(0)
    assert snapshots.take() == 1
    snapshots.reset()
    assert snapshots.held == 0 and snapshots.usable_hit([3]) == (0, None)
    assert untakeable(snapshots) == set()
    assert [snapshots.take(), snapshots.take()] == [0, 1]


# --------------------------------------------------------------------- through the scheduler


class HybridAgent(FakeAgent):
    """FakeAgent (KV checked position by position) with Gated DeltaNet states: a slot's state is
    the token prefix it has taken in; a snapshot slot's, the prefix it was saved after."""

    def __init__(self, num_slots: int, block_size: int, snapshots: int):
        super().__init__(num_slots, block_size)
        self.state: dict[int, tuple[int, ...]] = {}
        self.snapshots: dict[int, tuple[int, ...]] = {}
        self.num_snapshots = snapshots
        self.moves: list[tuple[int, int, int | None, int | None]] = []  # (start, end, restore, save)

    def chunk_state(self, slot, tokens, start, restore, save):
        end = len(tokens)
        for value in (restore, save):
            assert value is None or 0 <= value < self.num_snapshots
        if restore is not None:
            assert start > 0, "a chunk from position 0 restores no state"
            assert restore in self.snapshots, f"snapshot {restore} was never saved"
            state = self.snapshots[restore]
        elif start == 0:
            state = ()
        else:  # the slot's own state goes on (the agent refuses a start elsewhere)
            state = self.state.get(slot, ())
        assert state == tuple(tokens[:start]), f"slot {slot}: a chunk from {start} starts from a wrong state"
        self.state[slot] = tuple(tokens[:end])
        if save is not None:
            self.snapshots[save] = tuple(tokens[:end])
        self.moves.append((start, end, restore, save))

    def release(self, slot):
        super().release(slot)
        self.state.pop(slot, None)

    def run(self, request: StepRequest) -> StepReply:
        slots = list(request.slots)
        decoded = self.decode(slots, list(request.tables), dict(request.drafts)) if slots else []
        for slot in slots:
            state = self.slots[slot]
            self.state[slot] = tuple(state["tokens"][: state["length"]])
        firsts = []
        for c in request.chunks:
            tokens = list(c.tokens)
            self.chunk_state(c.slot, tokens, c.start, c.restore, c.save)
            token = self.prefill(c.slot, tokens, c.table, c.start, len(tokens), c.sampling is not None)
            firsts.append(None if token is None else Sampled(token))
        return StepReply([sampled(t) for t in decoded], firsts)


def hybrid(slots=2, snapshots=2, max_seq_len=128, num_blocks=32, max_chunk=48, mixed_rows=0, **kw):
    capacity = GroupCapacity(
        slots,
        max_seq_len,
        num_blocks,
        SIZE,
        max_chunk,
        mixed_rows=mixed_rows,
        max_batch=8,
        state_snapshots=snapshots,
    )
    return BatchScheduler([capacity], 8, **kw), HybridAgent(slots, SIZE, snapshots)


def outcomes(plan, agent):
    """The plan's releases and calls run on the agent, in order: their outcomes."""
    done = []
    for part in plan.parts.values():
        for release in part.releases:
            agent.release(release.slot)
        for planned in part.steps:
            done.append(answered(planned, agent.run(planned.request)))
    return done


def step(scheduler, agent):
    plan = scheduler.schedule()
    scheduler.update(outcomes(plan, agent))
    return plan


def run_all(scheduler, agent, limit=1000):
    for _ in range(limit):
        if not (scheduler.num_running or scheduler.num_waiting):
            step(scheduler, agent)  # the last releases
            return
        step(scheduler, agent)
    raise AssertionError("the requests never finished")


def spans(plan):
    return [(c.seq.request_id, c.start, c.end, c.restore, c.save) for c in plan.prefills]


def wire(plan):
    """The chunks as the step requests carry them: (start, end, restore, save)."""
    return [
        (c.start, len(c.tokens), c.restore, c.save)
        for part in plan.parts.values()
        for planned in part.steps
        for c in planned.request.chunks
    ]


PROMPT = list(range(1, 71))  # 70 tokens: 4 full blocks of 16, the last boundary at 64


def computed_alone(scheduler, agent, request):
    scheduler.add(request)
    run_all(scheduler, agent)
    assert request.finish_reason is FinishReason.LENGTH


def test_a_prompt_saves_its_state_at_its_last_block_boundary_once_the_step_ran():
    scheduler, agent = hybrid()
    snapshots = scheduler.placement.snapshots[0]
    a = seq("a", PROMPT, max_new=3)
    scheduler.add(a)
    assert a.state_saves == [] and a.state_restore is None  # placed by the first plan
    plan = step(scheduler, agent)
    assert spans(plan) == [("a", 0, 48, None, None)]
    assert a.state_saves == [64] and snapshots.held == 0
    plan = scheduler.schedule()
    assert spans(plan) == [("a", 48, 64, None, 0)]  # cut at its save point (max_chunk: 48)
    assert wire(plan) == [(48, 64, None, 0)]
    assert snapshots.held == 0 and untakeable(snapshots) == {0}  # reserved, not yet hit-able
    scheduler.update(outcomes(plan, agent))
    assert snapshots.held == 1 and a.state_saves == []
    blocks = scheduler.blocks[0]
    assert snapshots.usable_hit(blocks.cached_serials(PROMPT)) == (4, 0)
    assert agent.snapshots[0] == tuple(PROMPT[:64])
    plan = step(scheduler, agent)
    assert spans(plan) == [("a", 64, 70, None, None)] and plan.prefills[0].sample
    run_all(scheduler, agent)
    assert a.output == [71, 72, 73] and snapshots.held == 1 and untakeable(snapshots) == set()


def test_the_same_prompt_again_restores_the_snapshot_and_computes_only_the_rest():
    scheduler, agent = hybrid()
    snapshots = scheduler.placement.snapshots[0]
    computed_alone(scheduler, agent, seq("a", PROMPT, max_new=3))
    computed = agent.computed_positions
    b = seq("b", PROMPT, max_new=3)
    scheduler.add(b)
    plan = scheduler.schedule()
    assert spans(plan) == [("b", 64, 70, 0, None)] and plan.prefills[0].sample
    assert wire(plan) == [(64, 70, 0, None)]
    assert b.state_restore == 0 and b.state_saves == []  # nothing new to save: 64 is held
    assert untakeable(snapshots) == {0}  # pinned until the chunk ran
    scheduler.update(outcomes(plan, agent))
    assert b.state_restore is None and untakeable(snapshots) == set()
    assert agent.moves[-1] == (64, 70, 0, None)
    run_all(scheduler, agent)
    assert b.output == [71, 72, 73] and agent.computed_positions - computed == 6
    assert scheduler.placement.prefix_hit_tokens == 64
    assert snapshots.restored == 1


def test_a_hit_without_a_snapshot_at_its_end_computes_from_the_last_one_and_saves_there():
    """C shares A's first 32 tokens (2 blocks) but A saved only at 64: no usable hit; C saves at
    32 (where the cached prefix ends) and at its own last boundary, 64. With 2 slots the second
    save evicts A's snapshot (the least recently used). A's prompt again then restores C's 32."""
    scheduler, agent = hybrid()
    snapshots, blocks = scheduler.placement.snapshots[0], scheduler.blocks[0]
    computed_alone(scheduler, agent, seq("a", PROMPT, max_new=3))
    c = seq("c", PROMPT[:32] + list(range(200, 238)), max_new=3)
    assert len(blocks.cached_serials(c.prompt)) == 2  # its KV is cached up to 32...
    scheduler.add(c)
    plan = step(scheduler, agent)
    assert spans(plan) == [("c", 0, 32, None, 1)]  # ...but no state there: from 0, saved at 32
    assert c.state_saves == [64] and snapshots.held == 2
    assert scheduler.placement.prefix_hit_tokens == 0
    plan = step(scheduler, agent)
    assert spans(plan) == [("c", 32, 64, None, 0)]  # A's 64 was the least recently used
    assert snapshots.usable_hit(blocks.cached_serials(PROMPT)) == (2, 1)
    assert snapshots.usable_hit(blocks.cached_serials(c.prompt)) == (4, 0)
    run_all(scheduler, agent)
    assert c.output == [238, 239, 240]
    d = seq("d", PROMPT, max_new=3)
    scheduler.add(d)
    plan = step(scheduler, agent)
    # from C's snapshot at 32 (the same prefix as A's first 32), saving again at 64
    assert spans(plan) == [("d", 32, 64, 1, 0)]
    run_all(scheduler, agent)
    assert d.output == [71, 72, 73]
    assert snapshots.usable_hit(blocks.cached_serials(PROMPT)) == (4, 0)


def test_a_salted_prompt_never_restores_an_unsalted_snapshot():
    scheduler, agent = hybrid()
    computed_alone(scheduler, agent, seq("a", PROMPT, max_new=3))
    b = seq("b", PROMPT, max_new=3)
    b.cache_salt = "tenant"
    scheduler.add(b)
    plan = step(scheduler, agent)
    assert spans(plan) == [("b", 0, 48, None, None)] and b.state_saves == [64]
    run_all(scheduler, agent)
    assert b.output == [71, 72, 73] and scheduler.placement.snapshots[0].restored == 0


def test_a_prompt_within_one_block_saves_nothing():
    scheduler, agent = hybrid()
    short = seq("short", list(range(1, 17)), max_new=2)  # 16 tokens: its last boundary is 0
    scheduler.add(short)
    plan = step(scheduler, agent)
    assert spans(plan) == [("short", 0, 16, None, None)] and short.state_saves == []
    run_all(scheduler, agent)
    assert scheduler.placement.snapshots[0].held == 0


def test_without_prefix_caching_no_state_is_saved_or_restored():
    scheduler, agent = hybrid(enable_prefix_caching=False)
    assert scheduler.placement.snapshots == [None]
    a = seq("a", PROMPT, max_new=2)
    scheduler.add(a)
    plan = step(scheduler, agent)
    plan2 = step(scheduler, agent)
    assert spans(plan) + spans(plan2) == [("a", 0, 48, None, None), ("a", 48, 70, None, None)]
    run_all(scheduler, agent)


def save_planned(scheduler, agent):
    """A placed and its first chunk run: the plan of its chunk that saves (into slot 0)."""
    a = seq("a", PROMPT, max_new=3)
    scheduler.add(a)
    step(scheduler, agent)
    plan = scheduler.schedule()
    assert spans(plan) == [("a", 48, 64, None, 0)]
    return a, plan


@pytest.mark.parametrize("how", ["refused", "internal"])
def test_a_failed_chunk_gives_back_the_snapshot_slot_it_reserved(how):
    scheduler, agent = hybrid()
    snapshots = scheduler.placement.snapshots[0]
    a, plan = save_planned(scheduler, agent)
    (planned,) = plan.parts[0].steps
    if how == "refused":
        outcome = refused(planned, "a bad chunk")
    else:
        outcome = StepOutcome(
            group=0, agent="fake", part=planned, error=RuntimeError("boom"), failure=Failure.INTERNAL
        )
    scheduler.update([outcome])
    assert a.finish_reason is FinishReason.ERROR and snapshots.held == 0
    assert untakeable(snapshots) == set()
    assert snapshots.take() == 0  # back among the free ones (slot 1 would come first otherwise)


def test_a_refused_mixed_step_gives_back_its_save_and_plans_it_again_alone():
    scheduler, agent = hybrid(mixed_rows=64)
    snapshots = scheduler.placement.snapshots[0]
    stream = seq("s", [500], max_new=30)
    scheduler.add(stream)
    step(scheduler, agent)
    a = seq("a", PROMPT, max_new=3)
    scheduler.add(a)
    plan = step(scheduler, agent)
    assert spans(plan) == [("a", 0, 48, None, None)]
    (mixed,) = scheduler.schedule().parts[0].steps
    assert mixed.mixed and [(c.start, c.end, c.save) for c in mixed.chunks] == [(48, 64, 0)]
    assert scheduler.update([refused(mixed, "a bad mix")]) == []  # nothing ran, nobody fails
    assert untakeable(snapshots) == set() and snapshots.held == 0 and not a.finished
    plan = scheduler.schedule()
    decode, alone = plan.parts[0].steps
    assert decode.plain_decode and [(c.start, c.end, c.save) for c in alone.chunks] == [(48, 64, 0)]
    scheduler.update(outcomes(plan, agent))
    assert snapshots.held == 1 and agent.snapshots[0] == tuple(PROMPT[:64])
    run_all(scheduler, agent)
    assert a.output == [71, 72, 73]


def test_a_chunk_whose_sequence_ended_meanwhile_registers_no_snapshot():
    scheduler, agent = hybrid()
    snapshots = scheduler.placement.snapshots[0]
    a, plan = save_planned(scheduler, agent)
    done = outcomes(plan, agent)  # the step ran; the client left before its outcome came back
    scheduler.finish_requests(["a"], FinishReason.ABORT)
    scheduler.update(done)
    assert snapshots.held == 0 and untakeable(snapshots) == set()
    assert snapshots.take() == 0


def test_a_failed_group_forgets_its_snapshots():
    scheduler, agent = hybrid()
    snapshots = scheduler.placement.snapshots[0]
    computed_alone(scheduler, agent, seq("a", PROMPT, max_new=3))
    assert snapshots.held == 1
    b = seq("b", PROMPT, max_new=3)
    scheduler.add(b)
    (planned,) = scheduler.schedule().parts[0].steps
    lost = StepOutcome(group=0, agent="fake", part=planned, error=OSError("gone"), failure=Failure.AGENT)
    scheduler.update([lost])
    assert b.finish_reason is FinishReason.ERROR
    assert snapshots.held == 0 and untakeable(snapshots) == set()


def restoring(scheduler, agent):
    """A computed alone (its snapshot at 64 in slot 0); B, the same prompt, placed with its
    restore pinned and its chunk planned: (B, that plan)."""
    computed_alone(scheduler, agent, seq("a", PROMPT, max_new=3))
    b = seq("b", PROMPT, max_new=3)
    scheduler.add(b)
    plan = scheduler.schedule()
    assert spans(plan) == [("b", 64, 70, 0, None)]
    assert untakeable(scheduler.placement.snapshots[0]) == {0}
    return b, plan


def test_a_sequence_ended_before_its_restore_ran_unpins_it():
    scheduler, agent = hybrid()
    snapshots = scheduler.placement.snapshots[0]
    b, plan = restoring(scheduler, agent)
    done = outcomes(plan, agent)
    scheduler.finish_requests(["b"], FinishReason.ABORT)
    assert b.state_restore is None and untakeable(snapshots) == set()
    scheduler.update(done)  # its chunk's outcome, late: nothing unpinned twice
    assert untakeable(snapshots) == set() and snapshots.held == 1
    computed_alone(scheduler, agent, seq("c", PROMPT, max_new=2))  # the snapshot still serves
    assert snapshots.restored == 2


def test_a_restore_refused_in_a_mixed_step_stays_pinned_and_a_preemption_unpins_it():
    scheduler, agent = hybrid(mixed_rows=64)
    snapshots = scheduler.placement.snapshots[0]
    computed_alone(scheduler, agent, seq("a", PROMPT, max_new=3))
    stream = seq("s", [500], max_new=30)
    scheduler.add(stream)
    step(scheduler, agent)
    b = seq("b", PROMPT, max_new=3)
    scheduler.add(b)
    (mixed,) = scheduler.schedule().parts[0].steps
    assert mixed.mixed and [(c.start, c.end, c.restore) for c in mixed.chunks] == [(64, 70, 0)]
    assert scheduler.update([refused(mixed, "a bad mix")]) == []
    assert b.state_restore == 0 and untakeable(snapshots) == {0}  # its chunk did not run: still read
    scheduler._preempt(b)  # as _plan_decodes does when a decode finds no block
    assert b.state_restore is None and b.state_saves == [] and untakeable(snapshots) == set()
    plan = step(scheduler, agent)  # placed again: the cache and the snapshot give 64 back
    assert spans(plan) == [("b", 64, 70, 0, None)]
    assert untakeable(snapshots) == set()  # read: unpinned once, not below zero
    scheduler.finish_requests(["s"], FinishReason.ABORT)
    run_all(scheduler, agent)
    assert b.output == [71, 72, 73] and untakeable(snapshots) == set()
    assert snapshots.restored == 2


def test_a_sequence_finished_after_its_restore_leaves_nothing_pinned():
    scheduler, agent = hybrid()
    snapshots = scheduler.placement.snapshots[0]
    b, plan = restoring(scheduler, agent)
    scheduler.update(outcomes(plan, agent))
    run_all(scheduler, agent)
    assert b.finish_reason is FinishReason.LENGTH and untakeable(snapshots) == set()
    assert scheduler.blocks[0].num_used == 0


def test_a_recompute_capped_below_the_snapshot_does_not_restore_a_later_state():
    """B, the same prompt as A, placed while A computes (no snapshot yet): it computes from 0,
    saving at 32. A saves at 64. B is preempted at 32 (its slot holds 32): its recompute may start
    at most at 32, so it must restore the snapshot of 32 (or start from 0), never A's of 64."""
    scheduler, agent = hybrid(max_chunk=32)
    a = seq("a", PROMPT, max_new=3)
    scheduler.add(a)
    step(scheduler, agent)
    b = seq("b", PROMPT, max_new=3)
    scheduler.add(b)
    plan = step(scheduler, agent)
    assert spans(plan) == [("a", 32, 64, None, 0), ("b", 0, 32, None, 1)]
    scheduler._preempt(b)
    assert b.slot_holds == 32
    plan = scheduler.schedule()
    (chunk,) = [c for c in plan.prefills if c.seq is b]
    # the state the restore holds must be that of the chunk's start
    assert chunk.restore is None or agent.snapshots[chunk.restore] == tuple(PROMPT[: chunk.start])


def test_a_prompt_placed_beside_a_holder_of_its_uncheckpointed_prefix_is_admitted_or_waits():
    """A (80 tokens, 5 of the 10 blocks) has computed 48 positions, no snapshot yet. B shares
    those 48 (3 blocks A holds) and needs 6 blocks: with the hit it takes 3 more, without it 6 and
    only 5 are free. Either B is admitted or it waits; the scheduler must not fail."""
    scheduler, agent = hybrid(num_blocks=10, max_seq_len=96)
    a = seq("a", list(range(1, 81)), max_new=3)
    scheduler.add(a)
    step(scheduler, agent)
    assert a.computed == 48 and scheduler.blocks[0].num_free == 5
    b = seq("b", list(range(1, 49)) + list(range(300, 340)), max_new=3)
    scheduler.add(b)
    step(scheduler, agent)  # AssertionError: place() checked the blocks
    run_all(scheduler, agent)
    assert a.output == [81, 82, 83] and b.output == [340, 341, 342]


def step_refusing(scheduler, agent, rng):
    """A plan run on the agent, a call with prompt chunks now and then refused (none of it ran)."""
    plan, done = scheduler.schedule(), []
    for part in plan.parts.values():
        for release in part.releases:
            agent.release(release.slot)
        for planned in part.steps:
            if planned.chunks and rng.random() < 0.1:
                done.append(refused(planned, "refused"))
            else:
                done.append(answered(planned, agent.run(planned.request)))
    scheduler.update(done)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    snapshots=st.integers(1, 3),
    num_blocks=st.integers(0, 8),  # beyond one sequence's longest: a short pool preempts
    max_chunk=st.sampled_from([8, 16, 24, 40]),
    budget=st.integers(16, 64),
    requests=st.lists(
        st.tuples(
            st.integers(0, 1),  # which shared prefix
            st.integers(0, 48),  # its length
            st.integers(1, 30),  # a tail of its own
            st.integers(1, 8),  # max_new_tokens
            st.integers(0, 30),  # arrives at this step
            st.one_of(st.none(), st.integers(0, 30)),  # aborted at this step
        ),
        min_size=1,
        max_size=10,
    ),
    seed=st.integers(0, 2**16),
)
def test_random_workloads_restore_only_the_right_states_and_leak_no_snapshot(
    snapshots, num_blocks, max_chunk, budget, requests, seed
):
    """Shared prefixes, aborts and refused calls: every chunk starts from the state of exactly
    its prefix (the fake agent checks), and at the end no snapshot slot is pinned or reserved.
    A pool of one longest sequence and a few blocks more: sequences are preempted and recomputed,
    from a snapshot where one holds their prefix."""
    rng = random.Random(seed)
    max_seq_len = 96
    num_blocks += max_seq_len // SIZE
    scheduler, agent = hybrid(
        slots=3,
        snapshots=snapshots,
        max_seq_len=max_seq_len,
        num_blocks=num_blocks,
        max_chunk=max_chunk,
        max_batched_tokens=budget,
    )
    prefixes = [[1000 * (k + 1) + i for i in range(48)] for k in range(2)]
    seqs = []
    for i, (k, shared, tail, max_new, _, _) in enumerate(requests):
        prompt = (prefixes[k][:shared] + [5000 + 100 * i + j for j in range(tail)])[: max_seq_len - 10]
        seqs.append(seq(f"q{i}", prompt, max_new, stop_ids=frozenset({EOS - 100})))
    for tick in range(3000):
        for s, (_, _, _, _, arrives, aborted) in zip(seqs, requests):
            if arrives == tick:
                scheduler.add(s)
            if aborted == tick:
                scheduler.finish_requests([s.request_id], FinishReason.ABORT)
        if tick > 31 and not (scheduler.num_running or scheduler.num_waiting):
            break
        step_refusing(scheduler, agent, rng)
    else:
        raise AssertionError("the workload never finished")
    step(scheduler, agent)
    store = scheduler.placement.snapshots[0]
    assert untakeable(store) == set() and scheduler.blocks[0].num_used == 0
    for s in seqs:
        if s.finish_reason is FinishReason.LENGTH:
            assert s.output == [s.prompt[-1] + j for j in range(1, len(s.output) + 1)]
