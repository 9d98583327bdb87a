"""BatchScheduler as pure logic, driven against fake agents (one per group) that enforce the runner's
slot rules."""

import dataclasses
import itertools
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agent.contract.sampling import Sampled, SamplingParams
from agent.contract.step import MAX_DRAFT_TOKENS, StepRequest
from agent.contract.step_reply import StepReply
from config.schema import SpeculationSection
from scheduler.agent_client import AgentRequestError, AgentUnavailable
from scheduler.batch_scheduler import BatchScheduler
from scheduler.client_share import ClientShares
from scheduler.engine_io import AdmissionError, EngineOutput, FaultKind, Refusal
from scheduler.plan import Failure, GroupCapacity, PlannedStep, Release, StepOutcome
from scheduler.sequence import FinishReason, Sequence
from scheduler.speculation.speculator import Speculator
from scheduler.step_costs import DECODE_STEP_EVERY

EOS = 99


class FakeAgent:
    """A group's agent as the scheduler must drive it: slots (sampling state) and a pool of KV
    blocks read and written through the tables it is sent. Each position's "KV" records the whole
    token prefix it was computed from, so a table that points at the wrong block, a prefix-cache
    hit on other tokens or a position never computed fails an assertion. The next token is the
    previous one + 1 (or, with a `cycle`, the next of the cycle: answers that repeat themselves, for
    speculative decoding's proposals)."""

    def __init__(self, num_slots: int, block_size: int, cycle: int = 0):
        self.num_slots, self.block_size, self.cycle = num_slots, block_size, cycle
        self.slots: dict[int, dict] = {}  # slot -> {"tokens": written so far + pending, "length"}
        self.kv: dict[tuple[int, int], tuple[int, ...]] = {}  # (block, offset) -> prefix
        self.calls: list[str] = []
        self.computed_positions = 0  # prompt positions computed, all chunks together
        self.held: dict[int, int] = {}  # slot -> positions it holds, as the runner counts them

    def next(self, token: int) -> int:
        return (token + 1) % self.cycle if self.cycle else token + 1

    def _check(self, table, tokens, upto):
        for p in range(upto):
            at = (table[p // self.block_size], p % self.block_size)
            assert self.kv.get(at) == tuple(tokens[: p + 1]), f"position {p}: wrong or missing KV"

    def _write(self, table, tokens, start, end):
        for p in range(start, end):
            self.kv[(table[p // self.block_size], p % self.block_size)] = tuple(tokens[: p + 1])

    def prefill(self, slot, tokens, table, start, end, sample):
        assert len(table) * self.block_size >= end and 0 <= start < end <= len(tokens)
        # the runner's rule: a free slot may start anywhere (a prefix-cache hit), an occupied one not
        # past the positions it holds
        assert start <= self.held.get(slot, start), f"slot {slot} holds {self.held[slot]}, not {start}"
        self.held[slot] = end
        self._check(table, tokens, start)
        self._write(table, tokens, start, end)
        self.computed_positions += end - start
        self.calls.append(f"prefill {slot} {start}:{end}")
        if not sample:  # a prompt's earlier chunk, or a preempted sequence's KV: the state is kept
            assert slot not in self.slots or end <= self.slots[slot]["length"]
            return None
        assert slot not in self.slots, f"prefill into busy slot {slot}"
        self.slots[slot] = {"tokens": list(tokens[:end]) + [self.next(tokens[end - 1])], "length": end}
        return self.next(tokens[end - 1])

    def decode(self, slots, tables, drafts=None):
        """Each slot's next token; with `drafts` (slot -> proposed tokens) each slot's proposals
        kept while they are its next tokens, and one more. The KV of every proposed position is
        written, kept or not (as the model's step does): a position read before it is written over
        fails the next check."""
        self.calls.append(f"decode {slots}")
        out = []
        for slot, table in zip(slots, tables):
            state = self.slots[slot]
            length, tokens = state["length"], state["tokens"]
            proposed = (drafts or {}).get(slot, [])
            if isinstance(proposed, int):  # a draft model's: here one that is always right
                proposed = [
                    *itertools.accumulate(range(proposed), lambda t, _: self.next(t), initial=tokens[-1])
                ][1:]
            assert len(table) * self.block_size >= length + 1 + len(proposed), "proposals without blocks"
            self._check(table, tokens, length)
            self._write(table, tokens + proposed, length, length + 1 + len(proposed))
            kept = []
            for token in proposed:
                if token != self.next(tokens[-1]):
                    break
                tokens.append(token)
                kept.append(token)
            tokens.append(self.next(tokens[-1]))
            state["length"] += len(kept) + 1
            self.held[slot] = state["length"]
            out.append([*kept, tokens[-1]])
        return out

    def release(self, slot):
        self.slots.pop(slot, None)  # none: a prompt that ended before its last chunk
        self.held.pop(slot, None)
        self.calls.append(f"release {slot}")


def sampled(tokens):
    return [Sampled(t) for t in tokens]


def seq(rid, prompt=(1, 2, 3), max_new=5, stop_ids=frozenset({EOS})):
    return Sequence(rid, list(prompt), SamplingParams(), max_new, stop_ids)


def run_on(agent: FakeAgent, request: StepRequest) -> StepReply:
    """The request as the group's agent answers it: its decode rows, then its chunks."""
    decoded = (
        agent.decode(list(request.slots), list(request.tables), dict(request.drafts)) if request.slots else []
    )
    firsts = []
    for c in request.chunks:
        token = agent.prefill(c.slot, list(c.tokens), c.table, c.start, len(c.tokens), c.sampling is not None)
        firsts.append(None if token is None else Sampled(token))
    return StepReply([sampled(t) for t in decoded], firsts)


def answered(planned: PlannedStep, reply: StepReply) -> StepOutcome:
    return StepOutcome(group=planned.group, agent="fake", part=planned, reply=reply)


def agent_lost(group: int, error: str) -> StepOutcome:
    """The group's agent failed (here, answering a release)."""
    return StepOutcome(
        group=group,
        agent="fake",
        part=Release(group, 0),
        error=AgentUnavailable(error),
        failure=Failure.AGENT,
    )


def refused(planned: PlannedStep, error: str) -> StepOutcome:
    return StepOutcome(
        group=planned.group,
        agent="fake",
        part=planned,
        error=AgentRequestError(error, "request"),
        failure=Failure.REFUSED,
    )


def ids(outputs: list[EngineOutput]) -> list[str]:
    return [o.request_id for o in outputs]


def step(scheduler, agents, busy=()):
    """One plan, its calls run on the fake agents in the plan's order, their outcomes updated."""
    plan = scheduler.schedule(busy)
    outcomes = []
    for part in plan.parts.values():
        for release in part.releases:
            agents[release.group].release(release.slot)
        for planned in part.steps:
            outcomes.append(answered(planned, run_on(agents[planned.group], planned.request)))
    scheduler.update(outcomes)
    return plan


def capacity(
    num_slots=2, max_seq_len=64, num_blocks=None, block_size=4, max_chunk=32, role="mixed", mixed_rows=0
):
    """A group's capacity; with `mixed_rows`, steps that mix decodes with prompt chunks or
    proposals (MAX_DRAFT_TOKENS a sequence), of at most 8 rows of logits."""
    blocks = num_blocks if num_blocks is not None else num_slots * max_seq_len // block_size
    proposals = MAX_DRAFT_TOKENS if mixed_rows else 0
    return GroupCapacity(
        num_slots,
        max_seq_len,
        blocks,
        block_size,
        max_chunk,
        role,
        mixed_rows=mixed_rows,
        max_batch=8,
        max_proposals=proposals,
    )


def make(
    slots=(2,),
    max_waiting=8,
    max_seq_len=64,
    num_blocks=None,
    block_size=4,
    max_chunk=32,
    cycle=0,
    mixed_rows=0,
    **kw,
):
    caps = [capacity(n, max_seq_len, num_blocks, block_size, max_chunk, mixed_rows=mixed_rows) for n in slots]
    return BatchScheduler(caps, max_waiting, **kw), [FakeAgent(n, block_size, cycle) for n in slots]


def prefilled(plan):
    return [chunk.seq for chunk in plan.prefills]


def run_all(scheduler, agents, limit=10_000):
    for _ in range(limit):
        if not (scheduler.num_running or scheduler.num_waiting):
            return
        step(scheduler, agents)
    raise AssertionError("the requests never finished")


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
    assert plan.releases == [Release(0, a.slot)] and prefilled(plan) == [c] and c.slot == a.slot
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
    scheduler, _ = make(max_waiting=1, max_seq_len=5)
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
    assert ids(scheduler.update([agent_lost(0, "gone")])) == ["run", "wait"]
    assert running.error == "agent fake failed: gone"
    assert waiting.error == "no agent is available: agent fake failed: gone"
    with pytest.raises(AdmissionError, match="no agent is available") as e:
        scheduler.add(seq("new"))
    assert e.value.reason is Refusal.NO_GROUP
    assert scheduler.tokens_in_flight == 0


def test_abort_all_ends_waiting_and_running_and_releases_the_slots():
    scheduler, _, run, wait = one_running_one_waiting()
    assert ids(scheduler.abort_all("shutting down")) == ["wait", "run"]
    assert all(s.finish_reason is FinishReason.ABORT and s.error == "shutting down" for s in (run, wait))
    assert (scheduler.num_running, scheduler.num_waiting, scheduler.tokens_in_flight) == (0, 0, 0)
    assert scheduler.schedule().releases == [Release(0, run.slot)]


def test_abort_waiting_running_and_in_flight():
    scheduler, agents, run, wait = one_running_one_waiting()
    assert ids(scheduler.finish_requests(["wait"], FinishReason.ABORT)) == ["wait"]
    assert wait.finish_reason is FinishReason.ABORT and scheduler.num_waiting == 0
    (planned,) = scheduler.schedule().parts[0].steps
    scheduler.finish_requests(["run"], FinishReason.ABORT)  # while its decode is "in flight"
    assert scheduler.update([answered(planned, run_on(agents[0], planned.request))]) == []
    assert run.finish_reason is FinishReason.ABORT and len(run.output) == 1
    assert scheduler.schedule().releases == [Release(0, run.slot)]
    assert scheduler.finish_requests(["unknown"], FinishReason.ABORT) == []


@pytest.mark.parametrize("max_new, first_token", [(1, 4), (5, EOS)])
def test_abort_during_a_prefill_whose_token_ends_the_sequence_counts_it_once(max_new, first_token):
    """The client left while the prefill ran, and the first token would end the sequence anyway
    (max_new_tokens 1, or EOS): tokens_in_flight went negative and stopped bounding anything."""
    scheduler, _ = make(max_tokens_in_flight=100)
    request = seq("a", max_new=max_new)
    scheduler.add(request)
    (planned,) = scheduler.schedule().parts[0].steps
    scheduler.finish_requests(["a"], FinishReason.ABORT)
    scheduler.update([answered(planned, StepReply([], [Sampled(first_token)]))])
    assert scheduler.tokens_in_flight == 0 and request.finish_reason is FinishReason.ABORT
    assert request.output == []


def test_requests_spread_over_groups_and_a_failed_group_fails_only_its_own():
    scheduler, agents = make(slots=(2, 2))
    seqs = [seq(str(i), max_new=30) for i in range(4)]
    for s in seqs:
        scheduler.add(s)
    step(scheduler, agents)
    assert sorted(s.group for s in seqs) == [0, 0, 1, 1]
    failed = ids(scheduler.update([agent_lost(1, "agent 1 timed out")]))
    assert set(failed) == {s.request_id for s in seqs if s.group == 1}
    assert all(s.finish_reason is FinishReason.ERROR and "timed out" in s.error for s in seqs if s.group == 1)
    newcomer = seq("new")
    scheduler.add(newcomer)
    plan = step(scheduler, agents)
    assert 1 not in plan.decodes and newcomer not in prefilled(plan)  # group 0 is full
    scheduler.group_recovered(1, capacity(2))
    agents[1] = FakeAgent(2, 4)
    plan = step(scheduler, agents)
    assert prefilled(plan) == [newcomer] and newcomer.group == 1


def test_external_finish_releases_the_slot():
    scheduler, agents = make()
    s = seq("s", max_new=50)
    scheduler.add(s)
    step(scheduler, agents)
    assert ids(scheduler.finish_requests(["s"], FinishReason.STOP)) == ["s"]
    assert scheduler.num_running == 0 and scheduler.schedule().releases == [Release(0, s.slot)]


def test_a_refused_mixed_step_runs_its_parts_alone_next_and_only_the_bad_one_fails():
    """The agent refused a decode and a prompt chunk in one call as a bad request (nothing ran):
    the scheduler plans the next step of that group part by part, so that only the bad request
    fails; the step after that mixes again."""
    scheduler, agents = make(slots=(2,), mixed_rows=32)
    a, b = seq("a", max_new=20), seq("b", prompt=(5, 6, 7))
    scheduler.add(a)
    step(scheduler, agents)
    scheduler.add(b)
    (mixed,) = scheduler.schedule().parts[0].steps
    assert mixed.mixed and mixed.decodes == (a,) and [c.seq for c in mixed.chunks] == [b]
    assert scheduler.update([refused(mixed, "a bad step")]) == []  # nothing ran: nothing is lost
    decode, prefill = scheduler.schedule().parts[0].steps
    assert decode.plain_decode and decode.decodes == (a,) and [c.seq for c in prefill.chunks] == [b]
    outputs = scheduler.update(
        [answered(decode, run_on(agents[0], decode.request)), refused(prefill, "b is bad")]
    )
    assert ids(outputs) == ["a", "b"] and a.output == [4, 5] and not a.finished
    assert b.finish_reason is FinishReason.ERROR and b.error == "b is bad"
    c = seq("c", prompt=(8, 9))
    scheduler.add(c)
    plan = scheduler.schedule()
    (mixed,) = plan.parts[0].steps
    assert plan.parts[0].releases == [Release(0, b.slot)] and mixed.mixed and mixed.chunks[0].seq is c


def test_a_call_that_fails_here_ends_its_sequences_and_not_their_group():
    scheduler, agents = make(slots=(2,))
    a, b = seq("a", max_new=20), seq("b", max_new=20)
    scheduler.add(a)
    scheduler.add(b)
    step(scheduler, agents)
    (decode,) = scheduler.schedule().parts[0].steps
    bug = StepOutcome(
        group=0, agent="fake", part=decode, error=RuntimeError("boom"), failure=Failure.INTERNAL
    )
    assert bug.group_failure is None and ids(scheduler.update([bug])) == ["a", "b"]
    assert all(s.error == "internal error: RuntimeError: boom" for s in (a, b)) and scheduler.healthy[0]


def disaggregated(decode_slots=(2,), prefill_slots=1):
    caps = [capacity(prefill_slots, role="prefill")]
    caps += [capacity(n, role="decode") for n in decode_slots]
    return BatchScheduler(caps, 8)


def test_prefill_group_slots_bound_transfers_and_transferring_sequences_are_not_decoded():
    scheduler = disaggregated(decode_slots=(2, 2))
    a, b = seq("a", max_new=4), seq("b", max_new=4)
    scheduler.add(a)
    scheduler.add(b)
    plan = scheduler.schedule()
    # One prefill slot: one transfer at a time; the decode group with the most free slots.
    assert prefilled(plan) == [a] and (a.prefill_group, a.prefill_slot) == (0, 0)
    assert a.group in (1, 2) and a.transferring and a.ticket is not None and not plan.decodes
    (transfer,) = plan.transfers
    assert transfer.group == 0 and transfer.send_to == (a.group, a.slot, a.ticket, (0,))
    assert scheduler.schedule().prefills == []  # b waits for the prefill slot
    scheduler.update([answered(transfer, StepReply([], [Sampled(7)]))])
    plan = scheduler.schedule()
    assert prefilled(plan) == [b] and plan.decodes == {a.group: [a]} and a.output == [7]
    assert b.group != a.group  # now the other decode group has more free slots


def test_failed_transfer_releases_the_decode_slot_with_its_ticket():
    scheduler = disaggregated()
    a = seq("a")
    scheduler.add(a)
    (transfer,) = scheduler.schedule().transfers
    scheduler.update([refused(transfer, "the decode agent did not acknowledge the KV")])
    assert a.finish_reason is FinishReason.ERROR and "acknowledge" in a.error
    plan = scheduler.schedule()
    assert plan.releases == [Release(1, a.slot, a.ticket)]
    assert scheduler.free_slots[0] == [0]  # the prefill group freed its own slot


def test_aborted_during_transfer_cancels_the_ticket_and_ignores_the_late_token():
    scheduler = disaggregated()
    a = seq("a")
    scheduler.add(a)
    (transfer,) = scheduler.schedule().transfers
    scheduler.finish_requests(["a"], FinishReason.ABORT)
    assert scheduler.schedule().releases == [Release(1, a.slot, a.ticket)]
    assert scheduler.update([answered(transfer, StepReply([], [Sampled(5)]))]) == []
    assert a.output == [] and scheduler.free_slots[0] == [0]


def test_prefill_group_failure_fails_its_transfers_and_leaves_no_path():
    scheduler = disaggregated()
    a = seq("a")
    scheduler.add(a)
    scheduler.schedule()
    assert ids(scheduler.update([agent_lost(0, "prefill agent died")])) == ["a"]
    assert a.finish_reason is FinishReason.ERROR
    assert scheduler.schedule().releases == [Release(1, a.slot, a.ticket)]
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
    scheduler.finish_requests(["b"], FinishReason.ABORT)
    c = seq("c")
    scheduler.add(c)
    plan = scheduler.schedule(busy={1})
    assert plan.releases == [] and plan.prefills == [] and list(plan.decodes) == [0]
    assert [s.request_id for s in plan.decodes[0]] == ["a"] and list(plan.parts) == [0]
    plan = scheduler.schedule()
    assert plan.releases == [Release(1, 0)] and prefilled(plan) == [c] and c.group == 1
    parts = plan.parts
    assert sorted(parts) == [0, 1]
    (prefill,) = parts[1].steps
    assert (
        parts[1].releases == plan.releases and prefill.chunks == (plan.prefills[0],) and not prefill.decodes
    )
    (decode,) = parts[0].steps
    assert decode.decodes == (a,) and not decode.chunks and not parts[0].releases


def alone(request: Sequence, **make_kw) -> list[int]:
    """The request's answer with the whole (default) group to itself."""
    scheduler, agents = make(**make_kw)
    copy = seq(request.request_id, request.prompt, request.max_new_tokens, request.stop_ids)
    scheduler.add(copy)
    run_all(scheduler, agents)
    return copy.output


def start_streams(scheduler, agents, count, max_new):
    """`count` one-token prompts, admitted and prefilled: decoding from the next step on."""
    streams = [seq(f"s{i}", prompt=(i + 1,), max_new=max_new) for i in range(count)]
    for s in streams:
        scheduler.add(s)
    step(scheduler, agents)
    return streams


def test_a_long_prompt_runs_in_chunks_within_the_budget_while_every_stream_decodes_each_step():
    scheduler, agents = make(slots=(3,), max_seq_len=256, max_chunk=32, max_batched_tokens=20)
    streams = start_streams(scheduler, agents, 2, max_new=60)
    long = seq("long", prompt=range(100, 200), max_new=3)
    scheduler.add(long)
    steps_with_chunks = 0
    while scheduler.num_running:
        ready = [s for s in streams if not s.finished]
        plan = step(scheduler, agents)
        sizes = [chunk.end - chunk.start for chunk in plan.prefills]
        assert sum(sizes) + len(plan.decodes.get(0, [])) <= 20  # the step's token budget
        assert all(s in plan.decodes.get(0, []) for s in ready)  # no stream waits for the prompt
        steps_with_chunks += bool(sizes)
    assert steps_with_chunks >= 100 // 18  # the prompt took several steps
    assert long.output == alone(long, max_seq_len=256) and all(s.output == alone(s) for s in streams)


def test_prompt_positions_beside_decode_rows_follow_the_learned_step_costs():
    scheduler, agents = make(slots=(3,), max_seq_len=256, max_batched_tokens=40, decode_stall_ratio=1.5)
    streams = start_streams(scheduler, agents, 2, max_new=80)
    costs = scheduler.step_costs[0]
    costs.decoded(2, 40, 0.020)
    costs.mixed(2, 40, [(0, 10)], 0.040)  # 2 ms a position: half of a 20 ms decode step is 5 positions
    long = seq("long", prompt=range(100, 160), max_new=2)
    scheduler.add(long)
    sizes = []
    while long.needs_prefill or not long.output:
        plan = step(scheduler, agents)
        assert all(s in plan.decodes[0] for s in streams)
        sizes.append(sum(c.end - c.start for c in plan.prefills))
    # one waiting prompt beside two streams weighs half a stream more: 5 * 1.5 positions a step
    assert max(sizes) == 7 and sum(sizes) == 60
    assert costs.prompt_positions(2, 40) == pytest.approx(5, abs=1)  # half a decode step alone


def test_a_burst_of_prompts_beside_few_streams_gets_a_larger_share_of_the_step():
    scheduler, agents = make(slots=(12,), max_seq_len=256, max_batched_tokens=200, decode_stall_ratio=1.5)
    streams = start_streams(scheduler, agents, 2, max_new=80)
    costs = scheduler.step_costs[0]
    costs.decoded(2, 40, 0.020)
    costs.mixed(
        2, 40, [(0, 10)], 0.040
    )  # 2 ms a position: 5 positions beside the streams for one prompt alone
    burst = [seq(f"p{i}", prompt=range(10 * i + 1, 10 * i + 11), max_new=3) for i in range(8)]
    for s in burst:
        scheduler.add(s)
    plan = step(scheduler, agents)
    assert all(s in plan.decodes[0] for s in streams)
    # 8 prompts wait beside 2 streams: the step may take 1 + 0.5 * (1 + 8 / 2) decode steps
    assert sum(c.end - c.start for c in plan.prefills) == pytest.approx(0.5 * 0.020 * 5 / 0.002, abs=1)  # 25
    run_all(scheduler, agents)
    assert all(s.output == alone(s, max_seq_len=256) for s in streams + burst)


def pooling_inputs(count: int) -> list[Sequence]:
    """An embedding job's inputs: pooling requests of 10 positions each, one token answered."""
    pooling = SamplingParams(pool="hidden")
    return [
        Sequence(f"e{i}", list(range(10 * i + 1, 10 * i + 11)), pooling, 1, frozenset({EOS}))
        for i in range(count)
    ]


def test_pooling_prompts_beside_streams_weigh_as_no_stream():
    """An embedding job's inputs (pooling requests: prompts that never decode) are batch work: eight
    of them waiting beside two streams leave a step what one waiting prompt would, where eight
    streams' prompts would take five times as much (the test above)."""
    scheduler, agents = make(slots=(12,), max_seq_len=256, max_batched_tokens=200, decode_stall_ratio=1.5)
    streams = start_streams(scheduler, agents, 2, max_new=80)
    costs = scheduler.step_costs[0]
    costs.decoded(2, 40, 0.020)
    costs.mixed(2, 40, [(0, 10)], 0.040)  # 2 ms a position
    inputs = pooling_inputs(8)
    for s in inputs:
        scheduler.add(s)
    plan = step(scheduler, agents)
    assert all(s in plan.decodes[0] for s in streams)
    assert sum(c.end - c.start for c in plan.prefills) == pytest.approx(0.5 * 0.020 / 0.002, abs=1)  # 5
    run_all(scheduler, agents)
    assert all(len(s.output) == 1 and s.finished for s in inputs)
    assert all(s.output == alone(s, max_seq_len=256) for s in streams)


def test_a_stream_queued_behind_pooling_requests_is_admitted_before_them():
    """An embedding job keeps every slot busy and more inputs queued: a chat arriving behind them
    takes the next free slot (and its prompt the step's call), in place of the inputs queued
    before it."""
    scheduler, agents = make(slots=(2,), max_seq_len=256, max_batched_tokens=200)
    inputs = pooling_inputs(6)
    for s in inputs:
        scheduler.add(s)
    step(scheduler, agents)  # two inputs take the slots, one computed (one call a step); four wait
    chat = seq("chat", prompt=range(100, 110), max_new=3)
    scheduler.add(chat)
    plan = step(scheduler, agents)
    # the first input is done: its slot goes to the chat, not to an input queued before it, and
    # the chat's prompt takes the step's call
    assert [c.seq.request_id for c in plan.prefills] == ["chat"]
    assert [s.request_id for s in scheduler.waiting] == ["e2", "e3", "e4", "e5"]
    run_all(scheduler, agents)
    assert chat.output == alone(chat, max_seq_len=256) and all(s.finished for s in inputs)


def test_pooling_inputs_beside_streams_take_their_own_share_and_leave_some_steps_to_decode_alone():
    """With pooling_stall_ratio, an embedding job's inputs beside decoding streams take what the
    learned costs allow at that ratio (the streams keep ~1 / ratio of their speed), at least a
    position a step; while the costs have not seen a decode step alone (every step mixed: the job
    never pauses), the inputs wait one step so that one is seen."""
    scheduler, agents = make(
        slots=(12,), max_seq_len=256, max_batched_tokens=200, decode_stall_ratio=1.5, pooling_stall_ratio=1.2
    )
    streams = start_streams(scheduler, agents, 2, max_new=200)
    inputs = pooling_inputs(8)
    for s in inputs:
        scheduler.add(s)
    costs = scheduler.step_costs[0]
    assert costs.wants_decode_step and step(scheduler, agents).prefills == []  # a decode step alone
    costs.decoded(2, 40, 0.020)
    costs.mixed(2, 40, [(0, 10)], 0.040)  # 2 ms a position
    plan = step(scheduler, agents)
    assert all(s in plan.decodes[0] for s in streams)
    # a fifth of a 20 ms decode step: 2 positions (a stream's prompt would get 5: the tests above)
    assert sum(c.end - c.start for c in plan.prefills) == pytest.approx(0.2 * 0.020 / 0.002, abs=1)
    for _ in range(DECODE_STEP_EVERY):
        costs.mixed(2, 40, [(0, 10)], 0.040)
    assert costs.wants_decode_step and step(scheduler, agents).prefills == []
    costs.decoded(2, 40, 0.020)
    assert not costs.wants_decode_step and step(scheduler, agents).prefills
    for _ in range(DECODE_STEP_EVERY // 2):
        costs.mixed(2, 40, [(0, 10)], 0.400)  # a position now costs far more than the ratio allows
    assert sum(c.end - c.start for c in step(scheduler, agents).prefills) == 1  # the job still advances
    run_all(scheduler, agents)
    assert all(len(s.output) == 1 and s.finished for s in inputs)
    assert all(s.output == alone(s, max_seq_len=256) for s in streams)


def test_pooling_inputs_without_decode_rows_take_one_call_a_step():
    """Without decode rows, an embedding job's inputs fill one mixed call a step (the last one cut
    to the call's rows), not a queue of calls a chat arriving meanwhile would wait for."""
    scheduler, agents = make(slots=(4,), max_seq_len=64, max_batched_tokens=64, mixed_rows=24)
    inputs = pooling_inputs(4)
    for s in inputs:
        scheduler.add(s)
    plan = step(scheduler, agents)
    [part] = plan.parts.values()
    [call] = part.steps
    assert call.mixed and [(c.seq.request_id, c.end - c.start) for c in call.chunks] == [
        ("e0", 10),
        ("e1", 10),
        ("e2", 4),
    ]
    run_all(scheduler, agents)
    assert all(len(s.output) == 1 and s.finished for s in inputs)


def test_prompts_without_decodes_share_one_call_where_they_fit():
    """Short inputs (queries, an embedding job's) arriving together run in one mixed call, not a call
    each; a prompt too long to share the call's rows runs alone beside them; answers as alone."""
    scheduler, agents = make(slots=(4,), max_seq_len=64, max_batched_tokens=64, mixed_rows=24)
    short = [seq(f"q{i}", prompt=range(10 * i + 1, 10 * i + 7), max_new=2) for i in range(3)]
    long = seq("long", prompt=range(100, 120), max_new=2)
    for s in (*short, long):
        scheduler.add(s)
    plan = step(scheduler, agents)
    [part] = plan.parts.values()
    calls = [sorted(c.seq.request_id for c in planned.chunks) for planned in part.steps]
    assert calls == [["q0", "q1", "q2"], ["long"]] and part.steps[0].mixed
    run_all(scheduler, agents)
    assert all(s.output == alone(s, max_seq_len=64) for s in (*short, long))


def test_a_short_prompt_gets_its_first_token_before_a_long_one_ends_which_still_advances():
    scheduler, agents = make(slots=(3,), max_seq_len=256, block_size=4, max_batched_tokens=12)
    [stream] = start_streams(scheduler, agents, 1, max_new=100)
    long = seq("long", prompt=range(100, 200), max_new=2)
    scheduler.add(long)
    step(scheduler, agents)
    short = seq("short", prompt=range(5, 13), max_new=2)  # 8 positions
    scheduler.add(short)
    plan = step(scheduler, agents)
    chunks = {c.seq.request_id: c.end - c.start for c in plan.prefills}
    # 11 positions beside the stream: the short prompt first, the oldest keeps its floor (a block)
    assert chunks == {"short": 7, "long": 4}
    plan = step(scheduler, agents)
    assert short.output and long.needs_prefill  # its answer began while the long one computes
    assert {c.seq.request_id: c.end - c.start for c in plan.prefills} == {"short": 1, "long": 10}
    run_all(scheduler, agents)
    assert [s.output == alone(s, max_seq_len=256) for s in (stream, long, short)] == [True] * 3


def test_a_shared_prefix_is_computed_once_and_answers_are_unchanged():
    scheduler, agents = make(slots=(2,), max_seq_len=128)
    system = list(range(1, 41))  # 10 full blocks of 4
    first = seq("first", prompt=system + [50], max_new=4)
    scheduler.add(first)
    run_all(scheduler, agents)
    computed = agents[0].computed_positions
    second = seq("second", prompt=system + [60, 61], max_new=4)
    scheduler.add(second)
    plan = step(scheduler, agents)
    assert [(c.start, c.end) for c in plan.prefills] == [(40, 42)]  # 40 positions from the cache
    run_all(scheduler, agents)
    assert agents[0].computed_positions - computed == 2
    assert second.output == alone(second, max_seq_len=128)
    blocks = scheduler.blocks[0]
    assert (blocks.query_tokens, blocks.hit_tokens) == (41 + 42, 40) and blocks.num_used == 0


def test_without_blocks_the_newest_sequence_is_preempted_and_every_answer_is_its_answer_alone():
    # 16 streams of up to 36 positions (9 blocks of 4) share 24 blocks: most must wait their turn.
    scheduler, agents = make(slots=(16,), max_seq_len=64, num_blocks=24, max_batched_tokens=64)
    requests = [seq(f"r{i}", prompt=(i + 1, i + 2, i + 3, i + 4, i + 5), max_new=31) for i in range(16)]
    for r in requests:
        scheduler.add(r)
    run_all(scheduler, agents)
    assert scheduler.preemptions > 0
    assert all(r.finish_reason is FinishReason.LENGTH and r.output == alone(r) for r in requests)
    assert scheduler.blocks[0].num_used == 0 and scheduler.tokens_in_flight == 0


def test_a_sequence_preempted_mid_recompute_restarts_within_what_its_slot_holds():
    """Preempted twice: the first recompute (no cache left) stops after one chunk, so its slot holds
    4 positions; meanwhile another sequence caches the same tokens. The second restore must not
    start past those 4 (the runner refuses an occupied slot's chunk past its length) nor write over the
    other's cached blocks; the answer is still its answer alone."""
    scheduler, agents = make(slots=(2,), num_blocks=16, max_chunk=4)
    blocks = scheduler.blocks[0]
    a = seq("a", prompt=range(1, 9), max_new=16)
    scheduler.add(a)
    while len(a.output) < 8:
        step(scheduler, agents)
    scheduler._preempt(a)  # as _plan_decodes does when a decode finds no block
    blocks.allocate("hog", range(100, 100 + 4 * blocks.num_free))  # evicts a's cached blocks
    blocks.free("hog")
    b = seq("b", prompt=a.tokens(a.positions_used), max_new=1)  # a's very tokens, cached by b
    scheduler.add(b)
    plan = step(scheduler, agents)
    assert [(c.seq, c.start, c.end) for c in plan.prefills] == [(a, 0, 4), (b, 0, 4)]
    scheduler._preempt(a)
    blocks.allocate("hog", range(200, 200 + 4 * blocks.num_free))  # a waits while b computes
    while b.needs_prefill:
        step(scheduler, agents)
    blocks.free("hog")
    plan = step(scheduler, agents)
    assert [(c.seq, c.start) for c in plan.prefills] == [(a, 4)]
    run_all(scheduler, agents)
    assert a.output == alone(a) and blocks.num_used == 0


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    block_size=st.sampled_from([1, 2, 4]),
    num_blocks=st.integers(12, 40),
    max_chunk=st.integers(1, 16),
    budget=st.integers(4, 24),
    caching=st.booleans(),
    stall=st.sampled_from([0.0, 1.2, 3.0]),
    requests=st.lists(
        st.tuples(
            st.lists(st.integers(1, 3), min_size=1, max_size=10),  # prompts that share prefixes
            st.integers(1, 12),  # max_new_tokens
            st.integers(0, 30),  # arrives at this step
            st.one_of(st.none(), st.integers(0, 40)),  # aborted at this step
        ),
        min_size=1,
        max_size=12,
    ),
    seed=st.integers(0, 2**16),
)
def test_random_workloads_keep_the_budget_lose_nothing_and_leak_no_block(
    block_size, num_blocks, max_chunk, budget, caching, stall, requests, seed
):
    """Random arrivals, aborts, busy steps and step costs on a small pool: every step stays within
    its budget, every sequence with its KV complete decodes unless it was just preempted, nothing
    starves, each answer equals its answer alone (the fake agent checks every KV position it reads),
    and at the end no block, slot or in-flight token is left."""
    rng = random.Random(seed)
    max_seq_len = min(24, num_blocks * block_size)  # a sequence alone always fits (agents plan so)
    kw = {"slots": (4,), "max_seq_len": max_seq_len, "num_blocks": num_blocks, "block_size": block_size}
    kw |= {"max_chunk": max_chunk}
    scheduler, agents = make(
        **kw, max_batched_tokens=budget, enable_prefix_caching=caching, decode_stall_ratio=stall
    )
    seqs = [seq(f"q{i}", prompt, max_new) for i, (prompt, max_new, _, _) in enumerate(requests)]
    for tick in range(2000):
        for s, (_, _, arrives, aborted) in zip(seqs, requests):
            if arrives == tick:
                scheduler.add(s)
            if aborted == tick:
                scheduler.finish_requests([s.request_id], FinishReason.ABORT)
        if tick > 31 and not (scheduler.num_running or scheduler.num_waiting):
            break
        if rng.random() < 0.2:  # the group's step is "in flight": nothing of it is planned
            assert scheduler.schedule(busy={0}).empty
            continue
        costs = scheduler.step_costs[0]  # what the agent's steps took
        costs.decoded(rng.randint(1, 4), rng.randint(1, 99), rng.uniform(0.01, 0.05))
        costs.mixed(rng.randint(1, 4), rng.randint(1, 99), [(0, rng.randint(1, 10))], rng.uniform(0.01, 0.2))
        complete = [s for s in scheduler.running.values() if not s.needs_prefill and s.output]
        preempted_before = {s.request_id: s.preemptions for s in complete}
        plan = step(scheduler, agents)
        decoded = plan.decodes.get(0, [])
        assert sum(c.end - c.start for c in plan.prefills) + len(decoded) <= budget
        for s in complete:
            assert s in decoded or s.preemptions > preempted_before[s.request_id], s.request_id
    else:
        raise AssertionError("the workload never finished")
    for s in seqs:
        if s.finish_reason is not FinishReason.ABORT:
            assert s.output == alone(s, **kw), s.request_id
    step(scheduler, agents)  # the last releases
    assert scheduler.blocks[0].num_used == 0 and scheduler.tokens_in_flight == 0
    assert agents[0].slots == {} and scheduler.free_slots[0] == [0, 1, 2, 3]


# ------------------------------------------------------------------------------- fairness


def client_seq(rid: str, client: str, priority: int = 0, max_new: int = 5) -> Sequence:
    s = seq(rid, max_new=max_new)
    s.client, s.priority = client, priority
    return s


def test_a_free_slot_goes_to_the_client_running_the_fewest():
    """Client a holds both slots and queued two more before b's one: b's request takes the next
    slot that frees, then a's continue in order."""
    scheduler, agents = make(slots=(2,))
    scheduler.add(client_seq("a1", "a", max_new=3))
    scheduler.add(client_seq("a2", "a", max_new=50))
    step(scheduler, agents)
    for rid in ("a3", "a4"):
        scheduler.add(client_seq(rid, "a", max_new=50))
    scheduler.add(client_seq("b1", "b"))
    step(scheduler, agents)
    assert sorted(scheduler.running) == ["a1", "a2"]
    while "a1" in scheduler.running:
        step(scheduler, agents)
    step(scheduler, agents)
    assert sorted(scheduler.running) == ["a2", "b1"]


def test_the_share_of_a_full_queue_refuses_the_client_over_it_and_admits_the_others():
    """max_waiting 4, no free slot: client a fills the queue (alone, it meets a full server); b,
    under its share (half: 2), is admitted past the bound, up to 1.5 times it, while a's next
    request is refused as over its share."""
    scheduler, _ = make(slots=(1,), max_waiting=4, clients=ClientShares(share=0.5))
    for i in range(5):  # one is placed at once (a free slot), four wait
        scheduler.add(client_seq(f"a{i}", "a"))
    scheduler.schedule()
    with pytest.raises(AdmissionError, match="queue is full") as alone:
        scheduler.add(client_seq("a5", "a"))
    assert alone.value.reason is Refusal.OVERLOADED
    scheduler.add(client_seq("b0", "b"))
    with pytest.raises(AdmissionError, match="client_share") as over:
        scheduler.add(client_seq("a5", "a"))
    assert over.value.reason is Refusal.CLIENT_LIMIT
    scheduler.add(client_seq("b1", "b"))
    with pytest.raises(AdmissionError, match="even for clients under their share") as full:
        scheduler.add(client_seq("c0", "c"))
    assert full.value.reason is Refusal.OVERLOADED


def test_one_client_alone_may_fill_every_slot():
    scheduler, agents = make(slots=(4,), max_waiting=4, clients=ClientShares(share=0.5))
    for i in range(6):
        scheduler.add(client_seq(f"a{i}", "a"))
    step(scheduler, agents)
    assert (scheduler.num_running, scheduler.num_waiting) == (4, 2)


def test_priority_orders_requests_within_their_clients_share():
    """scheduling_policy priority: lower first among clients running alike; a client's priority
    does not jump another client's fair share."""
    scheduler, agents = make(slots=(2,), clients=ClientShares(by_priority=True))
    scheduler.add(client_seq("hold", "a", max_new=60))
    step(scheduler, agents)
    scheduler.add(client_seq("a-late", "a", priority=5))
    scheduler.add(client_seq("a-urgent", "a", priority=-5))
    scheduler.add(client_seq("b-low", "b", priority=9))
    order = []
    for _ in range(40):
        step(scheduler, agents)
        order += [r for r in scheduler.running if r not in order and r != "hold"]
    assert order == ["b-low", "a-urgent", "a-late"]


def test_a_client_at_its_running_cap_waits_while_slots_are_free():
    scheduler, agents = make(slots=(4,), clients=ClientShares(max_running=2))
    for i in range(3):
        scheduler.add(client_seq(f"a{i}", "a"))
    scheduler.add(client_seq("b0", "b"))
    step(scheduler, agents)
    assert sorted(scheduler.running) == ["a0", "a1", "b0"] and scheduler.num_waiting == 1


def test_a_sampling_fault_ends_only_its_sequence():
    """The agent's reply carries a fault for one sequence of a step: it ends with an error of the
    fault's kind, its slot is released; the other sequence goes on."""
    from agent.contract.sampling import NO_TOKEN, SequenceFault

    scheduler, agents = make(slots=(2,))
    a, b = seq("a", max_new=10), seq("b", max_new=10)
    scheduler.add(a)
    scheduler.add(b)
    step(scheduler, agents)
    (planned,) = scheduler.schedule().parts[0].steps
    assert planned.decodes == (a, b)
    fault = SequenceFault("request", "no token can follow")
    scheduler.update([answered(planned, StepReply([[Sampled(NO_TOKEN, None, fault)], [Sampled(5)]], []))])
    assert a.finish_reason is FinishReason.ERROR and (a.error, a.fault) == (
        "no token can follow",
        FaultKind.REQUEST,
    )
    assert NO_TOKEN not in a.output and not b.finished and b.output[-1] == 5
    assert [r.slot for r in scheduler.schedule().releases] == [a.slot]


# ------------------------------------------------------------------------------- speculative decoding


def speculator(num_tokens=4) -> Speculator:
    return Speculator(SpeculationSection(method="ngram", num_tokens=num_tokens, ngram_min=1, ngram_max=3))


def steps_to_finish(scheduler, agents, limit=1000) -> int:
    for steps in range(limit):
        if not (scheduler.num_running or scheduler.num_waiting):
            return steps
        step(scheduler, agents)
    raise AssertionError("the requests never finished")


def test_proposals_are_kept_where_right_and_answers_equal_those_without_them():
    """Answers that cycle through 0..6 repeat themselves: after one cycle the n-gram proposals are
    the answer's next tokens, and a step keeps them all and gives one more. Each answer equals its
    answer without proposals, in fewer steps, and when they end no block is held."""
    runs = {}
    for name, proposer in (("plain", None), ("speculating", speculator())):
        scheduler, agents = make(slots=(4,), mixed_rows=32, cycle=7, speculator=proposer)
        requests = [seq(f"r{i}", prompt=(i, i + 1, i + 2), max_new=40) for i in range(3)]
        for r in requests:
            scheduler.add(r)
        steps = steps_to_finish(scheduler, agents)
        step(scheduler, agents)  # the last releases
        assert scheduler.blocks[0].num_used == 0 and agents[0].slots == {}
        runs[name] = ([r.output for r in requests], steps, scheduler)
    (plain, plain_steps, _), (fast, fast_steps, spec) = runs["plain"], runs["speculating"]
    assert fast == plain and all(len(answer) == 40 for answer in fast)
    assert fast_steps < 0.6 * plain_steps, (fast_steps, plain_steps)  # 4 proposals a step: <= 7 tokens, not 3
    assert 0 < spec.drafts.accepted_tokens <= spec.drafts.proposed_tokens


def test_a_stop_among_the_kept_proposals_ends_the_answer_there():
    """The step keeps 4 proposals and gives a fifth token; the third kept is a stop id: the answer
    ends with it, the tokens after it are not the answer's, and its blocks go back."""
    proposer = speculator()
    scheduler, agents = make(slots=(2,), mixed_rows=32, cycle=7, speculator=proposer)
    request = Sequence("r", [1, 2, 3, 4, 5, 6, 0, 1, 2], SamplingParams(), 20, frozenset({6}))
    proposer.state(request).kept_weight = 50  # known to copy: all 4 pay (its proposal lengths)
    scheduler.add(request)
    step(scheduler, agents)  # the prompt: its first token 3
    plan = step(scheduler, agents)  # proposes 4 5 6 0 after the 3, the agent keeps all and adds 1
    assert plan.drafts == {"r": [4, 5, 6, 0]}
    assert request.output == [3, 4, 5, 6] and request.finish_reason is FinishReason.STOP
    step(scheduler, agents)
    assert scheduler.blocks[0].num_used == 0 and scheduler.tokens_in_flight == 0


@pytest.mark.parametrize("most", [0, 2])
def test_proposals_stay_within_what_the_groups_agent_verifies(most):
    """An agent that verifies at most `most` proposals a sequence (a hybrid model's held state rows;
    0: none, its states hold no rows for them) gets no more, whatever the speculator's num_tokens."""
    proposer = speculator()
    group = dataclasses.replace(capacity(mixed_rows=32), max_proposals=most)
    scheduler, agents = BatchScheduler([group], 8, speculator=proposer), [FakeAgent(2, 4, 7)]
    request = Sequence("r", [1, 2, 3, 4, 5, 6, 0, 1, 2], SamplingParams(), 20, frozenset())
    proposer.state(request).kept_weight = 50  # known to copy: all 4 would pay
    scheduler.add(request)
    step(scheduler, agents)  # the prompt: its first token 3
    plan = step(scheduler, agents)
    assert plan.drafts == ({"r": [4, 5]} if most else {})


def test_rejected_proposals_give_back_their_blocks_and_failing_sequences_back_off():
    """An answer that never repeats (each token the last + 1) after a prompt where each of its
    tokens is followed by a 0: the prompt's n-grams propose tokens the agent rejects; after every
    step the table holds no more than the blocks of the written positions and the pending token's,
    and after steps that keep nothing the sequence proposes less and less often."""
    scheduler, agents = make(
        slots=(2,), max_seq_len=128, block_size=2, max_chunk=128, mixed_rows=32, speculator=speculator()
    )
    request = seq("r", prompt=[x for t in range(9, 40) for x in (t, 0)] + [8], max_new=30)
    scheduler.add(request)
    proposing = []
    blocks = scheduler.blocks[0]
    for _ in range(28):
        plan = step(scheduler, agents)
        proposing.append("r" in plan.drafts)
        if request.finished:
            break
        assert len(blocks.table("r")) <= blocks.blocks_for(request.computed + 1)
    assert request.output == list(range(9, 39))[: len(request.output)]
    assert scheduler.drafts.accepted_tokens == 0 < scheduler.drafts.proposed_tokens
    assert request.speculation is not None and request.speculation.backoff > 1
    # the prompt's step, then: propose, skip 1, propose, skip 2, propose, skip 4, propose
    assert proposing[:12] == [False, True, False, True, False, False, True, *[False] * 4, True]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    num_blocks=st.integers(6, 16),
    requests=st.lists(
        st.tuples(
            st.lists(st.integers(0, 4), min_size=1, max_size=10), st.integers(1, 14), st.integers(0, 12)
        ),
        min_size=1,
        max_size=8,
    ),
    cycle=st.sampled_from([5, 0]),  # answers that repeat (proposals kept) or not (rejected)
)
def test_speculating_workloads_under_preemption_equal_their_answers_alone_and_leak_no_block(
    num_blocks, requests, cycle
):
    """Random prompts arriving over time on a pool small enough to preempt: with proposals, every
    answer equals its answer alone without them, the proposals never take a block a decode needs
    (a step's rows and blocks hold), and at the end no block, slot or in-flight token is left."""
    kw = {"slots": (4,), "max_seq_len": min(24, num_blocks * 2), "num_blocks": num_blocks, "block_size": 2}
    kw |= {"mixed_rows": 16, "cycle": cycle}
    scheduler, agents = make(**kw, speculator=speculator(num_tokens=3))
    seqs = [seq(f"q{i}", prompt, max_new) for i, (prompt, max_new, _) in enumerate(requests)]
    for tick in range(2000):
        for s, (_, _, arrives) in zip(seqs, requests):
            if arrives == tick:
                scheduler.add(s)
        if tick > 12 and not (scheduler.num_running or scheduler.num_waiting):
            break
        plan = step(scheduler, agents)
        decoded = plan.decodes.get(0, [])
        assert len(decoded) + plan.proposed(decoded) + sum(c.end - c.start for c in plan.prefills) <= 512
    else:
        raise AssertionError("the workload never finished")
    for s in seqs:
        assert s.output == alone(s, **kw), s.request_id
    step(scheduler, agents)
    assert scheduler.blocks[0].num_used == 0 and scheduler.tokens_in_flight == 0 and agents[0].slots == {}


def test_a_draft_models_proposals_are_counts_the_agent_fills():
    """With method draft the plan asks the agent for a number of tokens; blocks are taken for
    them, and an agent whose draft is always right gives k + 1 tokens a step."""
    settings = SpeculationSection(method="draft", draft_model="/nonexistent/draft", num_tokens=3)
    scheduler, agents = make(slots=(2,), mixed_rows=32, speculator=Speculator(settings))
    request = seq("r", prompt=(1, 2, 3), max_new=13)
    scheduler.add(request)
    step(scheduler, agents)
    plan = step(scheduler, agents)
    assert plan.drafts == {"r": 3} and request.output == [4, 5, 6, 7, 8]
    assert steps_to_finish(scheduler, agents) == 2 and request.output == list(range(4, 17))
    assert scheduler.drafts.accepted_tokens == scheduler.drafts.proposed_tokens == 9
