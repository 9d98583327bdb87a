"""BatchScheduler: continuous batching of sequences over the agents' KV slots. Pure logic: no
sockets, no asyncio; the server's loop asks it for a plan, runs the plan on the agents and reports
the results back.

    plan = scheduler.schedule()     # releases, then prefills (admitted from the FIFO queue), decodes
    ... run plan.releases, then plan.prefills, then plan.decodes on the agents, in that order ...
    scheduler.prefilled(seq, token); scheduler.decoded(seqs, tokens)

A finished sequence's slot goes into the next plan's releases, and only that plan may give it to a
waiting sequence: the release runs first, so a slot is never prefilled while the agent still holds
the previous sequence, and the next request enters on the very next iteration.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

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


@dataclass
class StepPlan:
    releases: list[tuple[int, int]] = field(default_factory=list)  # (agent, slot)
    prefills: list[Sequence] = field(default_factory=list)  # seq.agent / seq.slot assigned
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
        self.pending_releases: list[tuple[int, int]] = []

    # ------------------------------------------------------------------------------- requests

    def add(self, seq: Sequence) -> None:
        usable = [a for a, ok in zip(self.agents, self.healthy) if ok]
        if not seq.prompt:
            raise AdmissionError("the prompt is empty", 400)
        if not usable:
            raise AdmissionError("no agent is available (every agent failed; waiting for it to "
                                 "come back)", 503)
        longest = max(a.max_prompt_len for a in usable)
        if len(seq.prompt) > longest:
            raise AdmissionError(f"the prompt has {len(seq.prompt)} tokens; the longest accepted "
                                 f"is {longest}", 413)
        # Requests a free slot will take on the next iteration do not count as waiting: a burst
        # that arrives between two iterations must not be refused while slots are idle.
        free = sum(len(f) for f, ok in zip(self.free_slots, self.healthy) if ok)
        if len(self.waiting) >= self.max_waiting + free:
            raise AdmissionError(f"the waiting queue is full ({self.max_waiting} requests)", 503,
                                 overload=True)
        # Generation stops at the last position, so no request holds more than max_seq_len.
        seq.token_budget = min(len(seq.prompt) + seq.max_new_tokens, max(a.max_seq_len for a in usable))
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
        for agent, slot in plan.releases:  # released before this plan's prefills run
            self.free_slots[agent].append(slot)
            self.free_slots[agent].sort()
        while self.waiting and len(plan.prefills) < self.max_prefills_per_step:
            agent = self._agent_for(self.waiting[0])
            if agent is None:
                break
            seq = self.waiting.popleft()
            seq.agent, seq.slot = agent, self.free_slots[agent].pop(0)
            seq.status = SequenceStatus.RUNNING
            self.running[seq.request_id] = seq
            plan.prefills.append(seq)
        newly = {id(s) for s in plan.prefills}
        for seq in self.running.values():
            # Just-admitted sequences decode from the next step, once their prefill has run.
            if id(seq) not in newly:
                plan.decodes.setdefault(seq.agent, []).append(seq)
        return plan

    def _agent_for(self, seq: Sequence) -> int | None:
        """The healthy agent with the most free slots that can take this prompt."""
        candidates = [i for i, a in enumerate(self.agents)
                      if self.healthy[i] and self.free_slots[i] and len(seq.prompt) <= a.max_prompt_len]
        return max(candidates, key=lambda i: len(self.free_slots[i]), default=None)

    # ------------------------------------------------------------------------------- results

    def prefilled(self, seq: Sequence, token: int) -> None:
        self._append(seq, token)

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
        self.pending_releases = [(a, s) for a, s in self.pending_releases if a != agent]
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
            self.pending_releases.append((seq.agent, seq.slot))
