"""BatchScheduler: continuous batching of sequences over the groups' KV slots. Pure logic: no
sockets, no asyncio; the engine loop (scheduler/engine.py) asks it for a plan, runs the plan on the
groups and reports the results back. A group is one model instance: one agent, or the agents of a
tensor-parallel group, which the scheduler sees as one.

    plan = scheduler.schedule()     # releases, then prefills (admitted from the FIFO queue), decodes
    plan = scheduler.schedule(busy={1})   # the same, leaving out groups whose step is in flight
    ... run plan.releases, then plan.prefills, then plan.decodes on the groups, in that order ...
    scheduler.prefilled(seq, token); scheduler.decoded(seqs, tokens)

A finished sequence's slot goes into the next plan's releases, and only that plan may give it to a
waiting sequence: the release runs first, so a slot is never prefilled while the group still holds
the previous sequence, and the next request enters on the very next iteration.

PD disaggregation: a sequence placed on a `decode` group also gets a slot of a `prefill` group and
a transfer ticket. Its prefill runs there and sends the KV to the decode slot, outside the plan's
order (decode steps never wait for it); `transferred()` or `transfer_failed()` reports the outcome.
Until then it is not decoded. A sequence that ends before its KV arrived releases its decode slot
with the ticket, which the decode group then refuses should the KV still come.
"""

from __future__ import annotations

import enum
import random
from collections import deque
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import NamedTuple

from scheduler.sequence import FinishReason, Sequence, SequenceStatus


class Refusal(str, enum.Enum):
    """Why a request is refused at once; the HTTP layer turns it into a status (server/errors.py)."""

    EMPTY_PROMPT = "empty_prompt"
    TOO_LONG = "too_long"  # the prompt is longer than any group accepts
    OVERLOADED = "overloaded"  # no room now (queue or tokens in flight): worth retrying soon
    NO_GROUP = "no_group"  # every group failed; waiting for one to come back
    NOT_READY = "not_ready"  # the engine has not connected to its groups yet
    SHUTTING_DOWN = "shutting_down"


class AdmissionError(Exception):
    """A request refused at once, with the reason."""

    def __init__(self, message: str, reason: Refusal):
        super().__init__(message)
        self.reason = reason


@dataclass
class GroupCapacity:
    """What the scheduler needs to know of one group (from its `info` reply)."""

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
    group: int
    slot: int
    ticket: int | None = None  # a KV transfer into the slot that will never be used


@dataclass
class StepPlan:
    releases: list[Release] = field(default_factory=list)
    # seq.group / seq.slot assigned; with seq.prefill_group set, a prefill there sends the KV
    prefills: list[Sequence] = field(default_factory=list)
    decodes: dict[int, list[Sequence]] = field(default_factory=dict)  # group -> its running seqs

    @property
    def empty(self) -> bool:
        return not (self.releases or self.prefills or self.decodes)

    def by_group(self) -> dict[int, StepPlan]:
        """The plan split into one plan per group it touches (a prefill belongs to the group that
        decodes it), in the same order within each group."""
        parts: dict[int, StepPlan] = {}
        for release in self.releases:
            parts.setdefault(release.group, StepPlan()).releases.append(release)
        for seq in self.prefills:
            parts.setdefault(seq.placement[0], StepPlan()).prefills.append(seq)
        for group, seqs in self.decodes.items():
            parts.setdefault(group, StepPlan()).decodes[group] = seqs
        return parts


class BatchScheduler:
    def __init__(
        self,
        groups: list[GroupCapacity],
        max_waiting: int,
        max_prefills_per_step: int = 4,
        max_tokens_in_flight: int | None = None,
    ):
        self.groups = groups
        self.max_waiting = max_waiting
        self.max_prefills_per_step = max_prefills_per_step
        # Bound on prompt + answer tokens of every admitted request (waiting and running).
        self.max_tokens_in_flight = max_tokens_in_flight
        self.tokens_in_flight = 0
        self.free_slots = [list(range(g.num_slots)) for g in groups]
        self.healthy = [True] * len(groups)
        self.waiting: deque[Sequence] = deque()
        self.running: dict[str, Sequence] = {}
        self.pending_releases: list[Release] = []

    # ------------------------------------------------------------------------------- requests

    def _usable(self, group: int) -> bool:
        """Healthy, and a decode-capable group has a way to get prompts (itself or a prefill group)."""
        capacity = self.groups[group]
        if not self.healthy[group]:
            return False
        if capacity.role == "decode":
            return any(self.healthy[i] and g.role == "prefill" for i, g in enumerate(self.groups))
        if capacity.role == "prefill":
            return any(self._usable(i) for i, g in enumerate(self.groups) if g.role == "decode")
        return True

    @property
    def can_serve(self) -> bool:
        """Some healthy group decodes, and gets prompts (prefills them itself or has a prefill group)."""
        return any(g.decodes and self._usable(i) for i, g in enumerate(self.groups))

    def add(self, seq: Sequence) -> None:
        usable = [g for i, g in enumerate(self.groups) if self._usable(i)]
        if not seq.prompt:
            raise AdmissionError("the prompt is empty", Refusal.EMPTY_PROMPT)
        if not self.can_serve:
            raise AdmissionError(
                "no agent is available (every agent failed; waiting for it to come back)", Refusal.NO_GROUP
            )
        longest = max(g.max_prompt_len for g in usable if g.prefills)
        if len(seq.prompt) > longest:
            raise AdmissionError(
                f"the prompt has {len(seq.prompt)} tokens; the longest accepted is {longest}",
                Refusal.TOO_LONG,
            )
        # Requests a free slot will take on the next iteration do not count as waiting: a burst
        # that arrives between two iterations must not be refused while slots are idle.
        free = sum(
            len(self.free_slots[i]) for i, g in enumerate(self.groups) if g.decodes and self._usable(i)
        )
        if len(self.waiting) >= self.max_waiting + free:
            raise AdmissionError(
                f"the waiting queue is full ({self.max_waiting} requests)", Refusal.OVERLOADED
            )
        # Generation stops at the last position, so no request holds more than max_seq_len.
        seq.token_budget = min(
            len(seq.prompt) + seq.max_new_tokens, max(g.max_seq_len for g in usable if g.decodes)
        )
        limit = self.max_tokens_in_flight
        if limit is not None and self.tokens_in_flight + seq.token_budget > limit:
            raise AdmissionError(
                f"too many tokens in flight: this request needs up to "
                f"{seq.token_budget} (prompt + max_new_tokens), "
                f"{limit - self.tokens_in_flight} of {limit} are free",
                Refusal.OVERLOADED,
            )
        self.tokens_in_flight += seq.token_budget
        self.waiting.append(seq)

    def abort(self, request_id: str) -> Sequence | None:
        """Finish a waiting or running sequence (client gone); its slot is released next step."""
        for seq in self.waiting:
            if seq.request_id == request_id:
                self.waiting.remove(seq)
                self._finish(seq, FinishReason.ABORT)
                return seq
        running = self.running.get(request_id)
        if running is not None:
            self._finish(running, FinishReason.ABORT)
        return running

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    # -------------------------------------------------------------------------------- planning

    def schedule(self, busy: Collection[int] = ()) -> StepPlan:
        """The next plan, leaving out the `busy` groups (their step is still in flight): their
        releases stay pending, nothing is placed on them, none of theirs decodes."""
        plan = StepPlan(releases=[r for r in self.pending_releases if r.group not in busy])
        self.pending_releases = [r for r in self.pending_releases if r.group in busy]
        for release in plan.releases:  # released before this plan's prefills run
            self.free_slots[release.group].append(release.slot)
            self.free_slots[release.group].sort()
        while self.waiting and len(plan.prefills) < self.max_prefills_per_step:
            placement = self._place(self.waiting[0], busy)
            if placement is None:
                break
            seq = self.waiting.popleft()
            seq.group, prefill_group = placement
            seq.slot = self.free_slots[seq.group].pop(0)
            if prefill_group is not None:
                seq.prefill_group, seq.prefill_slot = prefill_group, self.free_slots[prefill_group].pop(0)
                seq.ticket, seq.transferring = random.getrandbits(62), True
            seq.status = SequenceStatus.RUNNING
            self.running[seq.request_id] = seq
            plan.prefills.append(seq)
        newly = {id(s) for s in plan.prefills}
        for seq in self.running.values():
            # Just-admitted sequences decode from the next step, once their prefill has run (or
            # their KV has arrived).
            group, _ = seq.placement
            if id(seq) not in newly and not seq.transferring and group not in busy:
                plan.decodes.setdefault(group, []).append(seq)
        return plan

    def _place(self, seq: Sequence, busy: Collection[int]) -> tuple[int, int | None] | None:
        """(group to decode on, prefill group or None): the healthy decode-capable group with the
        most free slots that can take this prompt; a decode group needs a prefill group with a
        free slot, the one with the most."""

        def fits(i: int) -> bool:
            return (
                self.healthy[i]
                and i not in busy
                and bool(self.free_slots[i])
                and len(seq.prompt) <= self.groups[i].max_prompt_len
            )

        prefill = max(
            (i for i, g in enumerate(self.groups) if g.role == "prefill" and fits(i)),
            key=lambda i: len(self.free_slots[i]),
            default=None,
        )
        candidates = [
            i
            for i, g in enumerate(self.groups)
            if g.decodes and fits(i) and (g.role == "mixed" or prefill is not None)
        ]
        group = max(candidates, key=lambda i: len(self.free_slots[i]), default=None)
        if group is None:
            return None
        return group, (prefill if self.groups[group].role == "decode" else None)

    # ------------------------------------------------------------------------------- results

    def prefilled(self, seq: Sequence, token: int) -> None:
        if not seq.finished:  # aborted while its prefill was in flight
            self._append(seq, token)

    def transferred(self, seq: Sequence, token: int) -> None:
        """Its prefill group sent the KV and the decode group took it: it decodes from now on."""
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
        """The prefill group frees its slot itself once the transfer is over, either way."""
        group, slot = seq.prefill_group, seq.prefill_slot
        seq.prefill_slot = None
        if slot is None:
            return
        assert group is not None, "a prefill slot comes with its prefill group"
        if self.healthy[group] and slot not in self.free_slots[group]:
            self.free_slots[group].append(slot)
            self.free_slots[group].sort()

    def decoded(self, seqs: list[Sequence], tokens: list[int]) -> None:
        for seq, token in zip(seqs, tokens):
            if not seq.finished:  # aborted while its step was in flight
                self._append(seq, token)

    def finish(self, seq: Sequence, reason: FinishReason) -> None:
        """Finish from outside the token rules (a stop string found in the text)."""
        if not seq.finished:
            self._finish(seq, reason)

    def group_failed(self, group: int, error: str) -> list[Sequence]:
        """The group is unusable: fail its sequences; its slots are forgotten until it returns."""
        self.healthy[group] = False
        failed = [s for s in self.running.values() if s.group == group]
        for seq in failed:
            seq.error = error
            self._finish(seq, FinishReason.ERROR, release=False)
        # Prompts whose prefill (and KV transfer) ran there: their decode slots are released.
        for seq in [s for s in self.running.values() if s.transferring and s.prefill_group == group]:
            seq.error = error
            self._finish(seq, FinishReason.ERROR)
            failed.append(seq)
        self.pending_releases = [r for r in self.pending_releases if r.group != group]
        self.free_slots[group] = []
        return failed

    def fail_waiting(self, error: str) -> list[Sequence]:
        """Fail every waiting sequence (no group is left to run them)."""
        failed = list(self.waiting)
        self.waiting.clear()
        for seq in failed:
            seq.error = error
            self._finish(seq, FinishReason.ERROR, release=False)
        return failed

    def abort_all(self, error: str) -> list[Sequence]:
        """Abort every waiting and running sequence, saying why (the engine stops)."""
        aborted = [*self.waiting, *self.running.values()]
        self.waiting.clear()
        for seq in aborted:
            seq.error = error
            self._finish(seq, FinishReason.ABORT)
        return aborted

    def group_recovered(self, group: int, capacity: GroupCapacity) -> None:
        self.groups[group] = capacity
        self.free_slots[group] = list(range(capacity.num_slots))
        self.healthy[group] = True

    def _append(self, seq: Sequence, token: int) -> None:
        seq.output.append(token)
        if token in seq.stop_ids:
            self._finish(seq, FinishReason.STOP)
        elif len(seq.output) >= seq.max_new_tokens:
            self._finish(seq, FinishReason.LENGTH)
        elif seq.positions_used >= self.groups[seq.placement[0]].max_seq_len:
            self._finish(seq, FinishReason.LENGTH)  # no position left to write the pending token

    def _finish(self, seq: Sequence, reason: FinishReason, release: bool = True) -> None:
        if seq.finished:  # once only: its tokens leave tokens_in_flight once
            return
        seq.status, seq.finish_reason = SequenceStatus.FINISHED, reason
        self.tokens_in_flight -= seq.token_budget
        if self.running.pop(seq.request_id, None) is not None and release:
            group, slot = seq.placement  # it ran, so it was placed
            self.pending_releases.append(Release(group, slot, seq.ticket if seq.transferring else None))
