"""BatchScheduler as pure logic, driven against fake agents (one per group) that enforce the runner's
slot rules."""

import pytest

from agent.contract.sampling import SamplingParams
from scheduler.batch_scheduler import AdmissionError, BatchScheduler, GroupCapacity, Refusal
from scheduler.sequence import FinishReason, Sequence

pytestmark = pytest.mark.unit

EOS = 99


class FakeAgent:
    """Slot bookkeeping like ModelRunner; the next token is the previous one + 1."""

    def __init__(self, num_slots: int):
        self.slots: dict[int, int] = {}
        self.num_slots = num_slots
        self.calls: list[str] = []

    def prefill(self, slot, prompt):
        assert slot not in self.slots, f"prefill into busy slot {slot}"
        self.slots[slot] = prompt[-1] + 1
        self.calls.append(f"prefill {slot}")
        return self.slots[slot]

    def decode(self, slots):
        assert all(s in self.slots for s in slots)
        self.calls.append(f"decode {slots}")
        for s in slots:
            self.slots[s] += 1
        return [self.slots[s] for s in slots]

    def release(self, slot):
        self.slots.pop(slot)
        self.calls.append(f"release {slot}")


def seq(rid, prompt=(1, 2, 3), max_new=5, stop_ids=frozenset({EOS})):
    return Sequence(rid, list(prompt), SamplingParams(), max_new, stop_ids)


def step(scheduler, agents):
    plan = scheduler.schedule()
    for group, slot, _ticket in plan.releases:
        agents[group].release(slot)
    for s in plan.prefills:
        scheduler.prefilled(s, agents[s.group].prefill(s.slot, s.prompt))
    for group, seqs in plan.decodes.items():
        scheduler.decoded(seqs, agents[group].decode([s.slot for s in seqs]))
    return plan


def make(slots=(2,), max_waiting=8, max_seq_len=64, max_prompt_len=32, **kw):
    caps = [GroupCapacity(n, max_seq_len, max_prompt_len) for n in slots]
    return BatchScheduler(caps, max_waiting, **kw), [FakeAgent(n) for n in slots]


def test_fifo_admission_and_continuous_batching():
    scheduler, agents = make(slots=(2,))
    a, b, c = seq("a", max_new=3), seq("b", max_new=6), seq("c", (10,), max_new=2)
    for s in (a, b, c):
        scheduler.add(s)
    step(scheduler, agents)
    assert (scheduler.num_running, scheduler.num_waiting) == (2, 1)  # c waits for a slot
    for _ in range(2):
        step(scheduler, agents)
    assert a.finished and a.finish_reason is FinishReason.LENGTH and a.output == [4, 5, 6]
    plan = step(scheduler, agents)  # a's slot is released, then c is admitted into it
    assert plan.releases == [(0, a.slot, None)] and plan.prefills == [c] and c.slot == a.slot
    assert agents[0].calls.index(f"release {a.slot}") < len(agents[0].calls) - 2
    while scheduler.num_running:
        step(scheduler, agents)
    assert b.output == [4, 5, 6, 7, 8, 9] and c.output == [11, 12]


def test_eos_stops_and_slot_end_stops():
    scheduler, agents = make(max_seq_len=8)
    eos = seq("eos", prompt=(96,), max_new=10)
    full = seq("full", prompt=(1, 2, 3, 4, 5), max_new=10)
    scheduler.add(eos)
    scheduler.add(full)
    while scheduler.num_running or scheduler.num_waiting:
        step(scheduler, agents)
    assert eos.output == [97, 98, 99] and eos.finish_reason is FinishReason.STOP
    # 5 prompt positions + 3 decodes fill 8 positions; the 4th output token can never be written
    assert full.output == [6, 7, 8, 9] and full.finish_reason is FinishReason.LENGTH
    step(scheduler, agents)
    assert agents[0].slots == {}  # every slot released on the agent


def test_admission_errors():
    scheduler, _ = make(max_waiting=1, max_prompt_len=4)
    with pytest.raises(AdmissionError, match="empty") as e:
        scheduler.add(seq("e", prompt=()))
    assert e.value.reason is Refusal.EMPTY_PROMPT
    with pytest.raises(AdmissionError, match="5 tokens; the longest accepted is 4") as e:
        scheduler.add(seq("long", prompt=(1, 2, 3, 4, 5)))
    assert e.value.reason is Refusal.TOO_LONG
    for i in range(3):  # 2 free slots + 1 waiting place: a burst is not refused while slots are idle
        scheduler.add(seq(f"ok{i}"))
    with pytest.raises(AdmissionError, match="queue is full") as e:
        scheduler.add(seq("more"))
    assert e.value.reason is Refusal.OVERLOADED


def test_tokens_in_flight_bound_counts_prompt_and_answer_until_the_end():
    scheduler, agents = make(slots=(4,), max_tokens_in_flight=40)
    first = seq("first", prompt=(1, 2, 3, 4, 5), max_new=25)  # 30 tokens
    scheduler.add(first)
    with pytest.raises(AdmissionError, match="needs up to 15 .* 10 of 40 are free") as e:
        scheduler.add(seq("second", prompt=(1, 2, 3, 4, 5), max_new=10))
    assert e.value.reason is Refusal.OVERLOADED
    scheduler.add(seq("small", prompt=(1, 2), max_new=8))
    assert scheduler.tokens_in_flight == 40
    while scheduler.num_running or scheduler.num_waiting:
        step(scheduler, agents)
    assert scheduler.tokens_in_flight == 0


def one_running_one_waiting():
    """One slot: a long answer running in it, a second request waiting."""
    scheduler, agents = make(slots=(1,))
    running, waiting = seq("run", max_new=50), seq("wait")
    scheduler.add(running)
    scheduler.add(waiting)
    step(scheduler, agents)
    return scheduler, agents, running, waiting


def test_no_healthy_group_refuses_new_requests_and_fails_the_waiting():
    scheduler, _, running, waiting = one_running_one_waiting()
    assert scheduler.group_failed(0, "gone") == [running]
    assert scheduler.fail_waiting("no agent") == [waiting] and waiting.error == "no agent"
    with pytest.raises(AdmissionError, match="no agent is available") as e:
        scheduler.add(seq("new"))
    assert e.value.reason is Refusal.NO_GROUP
    assert scheduler.tokens_in_flight == 0


def test_abort_all_ends_waiting_and_running_and_releases_the_slots():
    scheduler, _, run, wait = one_running_one_waiting()
    assert scheduler.abort_all("shutting down") == [wait, run]
    assert all(s.finish_reason is FinishReason.ABORT and s.error == "shutting down" for s in (run, wait))
    assert (scheduler.num_running, scheduler.num_waiting, scheduler.tokens_in_flight) == (0, 0, 0)
    assert scheduler.schedule().releases == [(0, run.slot, None)]


def test_abort_waiting_running_and_in_flight():
    scheduler, agents, run, wait = one_running_one_waiting()
    assert scheduler.abort("wait") is wait and wait.finish_reason is FinishReason.ABORT
    assert scheduler.num_waiting == 0
    plan = scheduler.schedule()
    scheduler.abort("run")  # while its decode is "in flight"
    scheduler.decoded(plan.decodes[0], agents[0].decode([run.slot]))
    assert run.finish_reason is FinishReason.ABORT and len(run.output) == 1
    assert scheduler.schedule().releases == [(0, run.slot, None)]
    assert scheduler.abort("unknown") is None


@pytest.mark.parametrize("max_new, first_token", [(1, 4), (5, EOS)])
def test_abort_during_a_prefill_whose_token_ends_the_sequence_counts_it_once(max_new, first_token):
    """The client left while the prefill ran, and the first token would end the sequence anyway
    (max_new_tokens 1, or EOS): tokens_in_flight went negative and stopped bounding anything."""
    scheduler, _ = make(max_tokens_in_flight=100)
    request = seq("a", max_new=max_new)
    scheduler.add(request)
    plan = scheduler.schedule()
    scheduler.abort("a")
    scheduler.prefilled(plan.prefills[0], first_token)
    assert scheduler.tokens_in_flight == 0 and request.finish_reason is FinishReason.ABORT
    assert request.output == []


def test_requests_spread_over_groups_and_a_failed_group_fails_only_its_own():
    scheduler, agents = make(slots=(2, 2))
    seqs = [seq(str(i), max_new=30) for i in range(4)]
    for s in seqs:
        scheduler.add(s)
    step(scheduler, agents)
    assert sorted(s.group for s in seqs) == [0, 0, 1, 1]
    failed = scheduler.group_failed(1, "agent 1 timed out")
    assert {s.request_id for s in failed} == {s.request_id for s in seqs if s.group == 1}
    assert all(s.finish_reason is FinishReason.ERROR and "timed out" in s.error for s in failed)
    newcomer = seq("new")
    scheduler.add(newcomer)
    plan = step(scheduler, agents)
    assert 1 not in plan.decodes and newcomer not in plan.prefills  # group 0 is full
    scheduler.group_recovered(1, GroupCapacity(2, 64, 32))
    agents[1] = FakeAgent(2)
    plan = step(scheduler, agents)
    assert plan.prefills == [newcomer] and newcomer.group == 1


def test_external_finish_releases_the_slot():
    scheduler, agents = make()
    s = seq("s", max_new=50)
    scheduler.add(s)
    step(scheduler, agents)
    scheduler.finish(s, FinishReason.STOP)
    assert scheduler.num_running == 0 and scheduler.schedule().releases == [(0, s.slot, None)]


def disaggregated(decode_slots=(2,), prefill_slots=1):
    caps = [GroupCapacity(prefill_slots, 64, 32, "prefill")]
    caps += [GroupCapacity(n, 64, 32, "decode") for n in decode_slots]
    return BatchScheduler(caps, 8)


def test_prefill_group_slots_bound_transfers_and_transferring_sequences_are_not_decoded():
    scheduler = disaggregated(decode_slots=(2, 2))
    a, b = seq("a", max_new=4), seq("b", max_new=4)
    scheduler.add(a)
    scheduler.add(b)
    plan = scheduler.schedule()
    # One prefill slot: one transfer at a time; the decode group with the most free slots.
    assert plan.prefills == [a] and (a.prefill_group, a.prefill_slot) == (0, 0)
    assert a.group in (1, 2) and a.transferring and a.ticket is not None and not plan.decodes
    assert scheduler.schedule().prefills == []  # b waits for the prefill slot
    scheduler.transferred(a, 7)
    plan = scheduler.schedule()
    assert plan.prefills == [b] and plan.decodes == {a.group: [a]} and a.output == [7]
    assert b.group != a.group  # now the other decode group has more free slots


def test_failed_transfer_releases_the_decode_slot_with_its_ticket():
    scheduler = disaggregated()
    a = seq("a")
    scheduler.add(a)
    scheduler.schedule()
    scheduler.transfer_failed(a, "the decode agent did not acknowledge the KV")
    assert a.finish_reason is FinishReason.ERROR and "acknowledge" in a.error
    plan = scheduler.schedule()
    assert plan.releases == [(1, a.slot, a.ticket)]
    assert scheduler.free_slots[0] == [0]  # the prefill group freed its own slot


def test_aborted_during_transfer_cancels_the_ticket_and_ignores_the_late_token():
    scheduler = disaggregated()
    a = seq("a")
    scheduler.add(a)
    scheduler.schedule()
    scheduler.abort("a")
    assert scheduler.schedule().releases == [(1, a.slot, a.ticket)]
    scheduler.transferred(a, 5)
    assert a.output == [] and scheduler.free_slots[0] == [0]


def test_prefill_group_failure_fails_its_transfers_and_leaves_no_path():
    scheduler = disaggregated()
    a = seq("a")
    scheduler.add(a)
    scheduler.schedule()
    failed = scheduler.group_failed(0, "prefill agent died")
    assert failed == [a] and a.finish_reason is FinishReason.ERROR
    assert scheduler.schedule().releases == [(1, a.slot, a.ticket)]
    assert not scheduler.can_serve
    with pytest.raises(AdmissionError, match="no agent is available"):
        scheduler.add(seq("b"))


def test_a_busy_group_is_left_out_of_the_plan_until_its_step_is_over():
    """Groups progress independently: while group 1's step is in flight, a plan holds only group 0's
    work, and group 1's release waits for the plan after its step, before any prefill into the slot."""
    scheduler, agents = make(slots=(1, 1))
    a, b = seq("a", max_new=50), seq("b", max_new=50)
    scheduler.add(a)
    scheduler.add(b)
    step(scheduler, agents)
    assert (a.group, b.group) == (0, 1)
    scheduler.abort("b")
    c = seq("c")
    scheduler.add(c)
    plan = scheduler.schedule(busy={1})
    assert plan.releases == [] and plan.prefills == [] and list(plan.decodes) == [0]
    assert [s.request_id for s in plan.decodes[0]] == ["a"]
    plan = scheduler.schedule()
    assert plan.releases == [(1, 0, None)] and plan.prefills == [c] and c.group == 1
    parts = plan.by_group()
    assert sorted(parts) == [0, 1]
    assert parts[1].releases == plan.releases and parts[1].prefills == [c] and parts[1].decodes == {}
    assert parts[0].decodes == {0: [a]} and not parts[0].releases and not parts[0].prefills
