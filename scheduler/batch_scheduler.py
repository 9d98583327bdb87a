"""BatchScheduler: continuous batching of sequences over the agents' KV slots. Pure logic: no
sockets, no asyncio; the server's loop asks it for a plan, runs the plan on the agents and reports
the results back.

    plan = scheduler.schedule()     # releases, then prefills (admitted from the FIFO queue), decodes
    ... run plan.releases, then plan.prefills, then plan.decodes on the agents, in that order ...
    scheduler.prefilled(seq, token); scheduler.decoded(seqs, tokens)

A finished sequence's slot goes into the next plan's releases, and only that plan may give it to a
waiting sequence: the release runs first, so a slot is never prefilled while the agent still holds
the previous sequence, and the next request enters on the very next iteration.

PD disaggregation: a sequence placed on a `decode` agent also gets a slot of a `prefill` agent and
a transfer ticket. Its prefill runs there and sends the KV to the decode slot, outside the plan's
order (decode steps never wait for it); `transferred()` or `transfer_failed()` reports the outcome.
Until then it is not decoded. A sequence that ends before its KV arrived releases its decode slot
with the ticket, which the decode agent then refuses should the KV still come.
"""
from __future__ import annotations

import random
from collections import deque
from dataclasses import dataclass, field
from typing import NamedTuple

from scheduler.sequence import FinishReason, Sequence, SequenceStatus


class AdmissionError(Exception):
    """A request the scheduler refuses at once; `status` says how the HTTP layer should answer.
    `overload`: refused for lack of room now (OpenAI clients expect 429 for that, and retry)."""

    def __init__(self, message: str, status: int, overload: bool = False):
        super().__init__(message)
        self.status = status
        self.overload = overload


@dataclass
class AgentCapacity:
    """What the scheduler needs to know of one agent (from its `info` reply)."""
    num_slots: int
    max_seq_len: int
    max_prompt_len: int
    role: str = "mixed"

    @property
    def prefills(self) -> bool:
        return self.role != "decode"

    @property
    def decodes(self) -> bool:
        return self.role != "prefill"


class Release(NamedTuple):
    agent: int
    slot: int
    ticket: int | None = None  # a KV transfer into the slot that will never be used


@dataclass
class StepPlan:
    releases: list[Release] = field(default_factory=list)
    # seq.agent / seq.slot assigned; with seq.prefill_agent set, a prefill there sends the KV
    prefills: list[Sequence] = field(default_factory=list)
    decodes: dict[int, list[Sequence]] = field(default_factory=dict)  # agent -> its running seqs

    @property
    def empty(self) -> bool:
        return not (self.releases or self.prefills or self.decodes)


class BatchScheduler:
    def __init__(self, agents: list[AgentCapacity], max_waiting: int, max_prefills_per_step: int = 4,
                 max_tokens_in_flight: int | None = None):
        self.agents = agents
        self.max_waiting = max_waiting
        self.max_prefills_per_step = max_prefills_per_step
        # Bound on prompt + answer tokens of every admitted request (waiting and running).
        self.max_tokens_in_flight = max_tokens_in_flight
        self.tokens_in_flight = 0
        self.free_slots = [list(range(a.num_slots)) for a in agents]
        self.healthy = [True] * len(agents)
        self.waiting: deque[Sequence] = deque()
        self.running: dict[str, Sequence] = {}
        self.pending_releases: list[Release] = []

    # ------------------------------------------------------------------------------- requests

    def _usable(self, agent: int) -> bool:
        """Healthy, and a decode-capable agent has a way to get prompts (itself or a prefill agent)."""
        capacity = self.agents[agent]
        if not self.healthy[agent]:
            return False
        if capacity.role == "decode":
            return any(self.healthy[i] and a.role == "prefill" for i, a in enumerate(self.agents))
        if capacity.role == "prefill":
            return any(self._usable(i) for i, a in enumerate(self.agents) if a.role == "decode")
        return True

    @property
    def can_serve(self) -> bool:
        """Some healthy agent decodes, and gets prompts (prefills them itself or has a prefill agent)."""
        return any(a.decodes and self._usable(i) for i, a in enumerate(self.agents))

    def add(self, seq: Sequence) -> None:
        usable = [a for i, a in enumerate(self.agents) if self._usable(i)]
        if not seq.prompt:
            raise AdmissionError("the prompt is empty", 400)
        if not self.can_serve:
            raise AdmissionError("no agent is available (every agent failed; waiting for it to "
                                 "come back)", 503)
        longest = max(a.max_prompt_len for a in usable if a.prefills)
        if len(seq.prompt) > longest:
            raise AdmissionError(f"the prompt has {len(seq.prompt)} tokens; the longest accepted "
                                 f"is {longest}", 413)
        # Requests a free slot will take on the next iteration do not count as waiting: a burst
        # that arrives between two iterations must not be refused while slots are idle.
        free = sum(len(self.free_slots[i]) for i, a in enumerate(self.agents)
                   if a.decodes and self._usable(i))
        if len(self.waiting) >= self.max_waiting + free:
            raise AdmissionError(f"the waiting queue is full ({self.max_waiting} requests)", 503,
                                 overload=True)
        # Generation stops at the last position, so no request holds more than max_seq_len.
        seq.token_budget = min(len(seq.prompt) + seq.max_new_tokens,
                               max(a.max_seq_len for a in usable if a.decodes))
        limit = self.max_tokens_in_flight
        if limit is not None and self.tokens_in_flight + seq.token_budget > limit:
            raise AdmissionError(f"too many tokens in flight: this request needs up to "
                                 f"{seq.token_budget} (prompt + max_new_tokens), "
                                 f"{limit - self.tokens_in_flight} of {limit} are free", 503,
                                 overload=True)
        self.tokens_in_flight += seq.token_budget
        self.waiting.append(seq)

    def abort(self, request_id: str) -> Sequence | None:
        """Finish a waiting or running sequence (client gone); its slot is released next step."""
        for seq in self.waiting:
            if seq.request_id == request_id:
                self.waiting.remove(seq)
                self._finish(seq, FinishReason.ABORT)
                return seq
        seq = self.running.get(request_id)
        if seq is not None:
            self._finish(seq, FinishReason.ABORT)
        return seq

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    # -------------------------------------------------------------------------------- planning

    def schedule(self) -> StepPlan:
        plan = StepPlan(releases=self.pending_releases)
        self.pending_releases = []
        for release in plan.releases:  # released before this plan's prefills run
            self.free_slots[release.agent].append(release.slot)
            self.free_slots[release.agent].sort()
        while self.waiting and len(plan.prefills) < self.max_prefills_per_step:
            placement = self._place(self.waiting[0])
            if placement is None:
                break
            seq = self.waiting.popleft()
            seq.agent, prefill_agent = placement
            seq.slot = self.free_slots[seq.agent].pop(0)
            if prefill_agent is not None:
                seq.prefill_agent, seq.prefill_slot = prefill_agent, self.free_slots[prefill_agent].pop(0)
                seq.ticket, seq.transferring = random.getrandbits(62), True
            seq.status = SequenceStatus.RUNNING
            self.running[seq.request_id] = seq
            plan.prefills.append(seq)
        newly = {id(s) for s in plan.prefills}
        for seq in self.running.values():
            # Just-admitted sequences decode from the next step, once their prefill has run (or
            # their KV has arrived).
            if id(seq) not in newly and not seq.transferring:
                plan.decodes.setdefault(seq.agent, []).append(seq)
        return plan

    def _place(self, seq: Sequence) -> tuple[int, int | None] | None:
        """(agent to decode on, prefill agent or None): the healthy decode-capable agent with the
        most free slots that can take this prompt; a decode agent needs a prefill agent with a
        free slot, the one with the most."""
        def fits(i: int) -> bool:
            return (self.healthy[i] and bool(self.free_slots[i])
                    and len(seq.prompt) <= self.agents[i].max_prompt_len)

        prefill = max((i for i, a in enumerate(self.agents) if a.role == "prefill" and fits(i)),
                      key=lambda i: len(self.free_slots[i]), default=None)
        candidates = [i for i, a in enumerate(self.agents) if a.decodes and fits(i)
                      and (a.role == "mixed" or prefill is not None)]
        agent = max(candidates, key=lambda i: len(self.free_slots[i]), default=None)
        if agent is None:
            return None
        return agent, (prefill if self.agents[agent].role == "decode" else None)

    # ------------------------------------------------------------------------------- results

    def prefilled(self, seq: Sequence, token: int) -> None:
        self._append(seq, token)

    def transferred(self, seq: Sequence, token: int) -> None:
        """Its prefill agent sent the KV and the decode agent took it: it decodes from now on."""
        self._free_prefill_slot(seq)
        seq.transferring = False
        if not seq.finished:  # aborted meanwhile: its decode slot is already being released
            self._append(seq, token)

    def transfer_failed(self, seq: Sequence, error: str) -> None:
        self._free_prefill_slot(seq)
        if not seq.finished:
            seq.error = error
            self._finish(seq, FinishReason.ERROR)

    def _free_prefill_slot(self, seq: Sequence) -> None:
        """The prefill agent frees its slot itself once the transfer is over, either way."""
        agent, slot = seq.prefill_agent, seq.prefill_slot
        seq.prefill_slot = None
        if slot is not None and self.healthy[agent] and slot not in self.free_slots[agent]:
            self.free_slots[agent].append(slot)
            self.free_slots[agent].sort()

    def decoded(self, seqs: list[Sequence], tokens: list[int]) -> None:
        for seq, token in zip(seqs, tokens):
            if not seq.finished:  # aborted while its step was in flight
                self._append(seq, token)

    def finish(self, seq: Sequence, reason: FinishReason) -> None:
        """Finish from outside the token rules (a stop string found in the text)."""
        if not seq.finished:
            self._finish(seq, reason)

    def agent_failed(self, agent: int, error: str) -> list[Sequence]:
        """The agent is unusable: fail its sequences; its slots are forgotten until it returns."""
        self.healthy[agent] = False
        failed = [s for s in self.running.values() if s.agent == agent]
        for seq in failed:
            seq.error = error
            self._finish(seq, FinishReason.ERROR, release=False)
        # Prompts whose prefill (and KV transfer) ran there: their decode slots are released.
        for seq in [s for s in self.running.values() if s.transferring and s.prefill_agent == agent]:
            seq.error = error
            self._finish(seq, FinishReason.ERROR)
            failed.append(seq)
        self.pending_releases = [r for r in self.pending_releases if r.agent != agent]
        self.free_slots[agent] = []
        return failed

    def fail_waiting(self, error: str) -> list[Sequence]:
        """Fail every waiting sequence (no agent is left to run them)."""
        failed = list(self.waiting)
        self.waiting.clear()
        for seq in failed:
            seq.error = error
            self._finish(seq, FinishReason.ERROR, release=False)
        return failed

    def agent_recovered(self, agent: int, capacity: AgentCapacity) -> None:
        self.agents[agent] = capacity
        self.free_slots[agent] = list(range(capacity.num_slots))
        self.healthy[agent] = True

    def _append(self, seq: Sequence, token: int) -> None:
        seq.output.append(token)
        if token in seq.stop_ids:
            self._finish(seq, FinishReason.STOP)
        elif len(seq.output) >= seq.max_new_tokens:
            self._finish(seq, FinishReason.LENGTH)
        elif seq.positions_used >= self.agents[seq.agent].max_seq_len:
            self._finish(seq, FinishReason.LENGTH)  # no position left to write the pending token

    def _finish(self, seq: Sequence, reason: FinishReason, release: bool = True) -> None:
        seq.status, seq.finish_reason = SequenceStatus.FINISHED, reason
        self.tokens_in_flight -= seq.token_budget
        if self.running.pop(seq.request_id, None) is not None and release:
            self.pending_releases.append(Release(seq.agent, seq.slot,
                                                 seq.ticket if seq.transferring else None))
