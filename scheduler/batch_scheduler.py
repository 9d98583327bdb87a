"""BatchScheduler: continuous batching of sequences over the groups' paged KV caches. Pure logic:
no sockets, no asyncio; the engine loop (scheduler/engine.py) asks it for a plan, runs the plan on
the groups and reports the results back. A group is one model instance: one agent, or the agents of
a tensor-parallel group, which the scheduler sees as one.

    plan = scheduler.schedule()     # releases, decodes, then prompt chunks within the token budget
    plan = scheduler.schedule(busy={1})   # the same, leaving out groups whose step is in flight
    ... run plan.releases, then plan.decodes, then plan.prefills on the groups, in that order ...
    scheduler.decoded(seqs, tokens); scheduler.prefilled(chunk, token or None)

The plan's parts are in scheduler/plan.py; the groups' slots, blocks and health, and where a new
sequence goes, in scheduler/placement.py; speculative decoding's proposals in scheduler/speculation/drafts.py;
what each client may hold (fair share) in scheduler/client_share.py.

Each step of a group spends at most `max_batched_tokens` positions: every decode row first (a
decode never waits for a prompt), then prompt chunks, oldest first: a long prompt spans several
steps, short ones share one. A prompt reuses the longest cached run of full blocks with the same
prefix (prefix caching) and computes the rest. When a decode needs a block and none is free, the
most recently admitted sequence of the group is preempted: its blocks go, it keeps its slot and its
tokens, and it is recomputed (a prompt chunk) before new admissions, losing nothing.

A finished sequence's slot goes into the next plan's releases, and only that plan may give it to a
waiting sequence: the release runs first, so a slot is never prefilled while the group still holds
the previous sequence, and the next request enters on the very next iteration. Its blocks are free
at once: a group's blocks are handed out only by a plan for that group, which runs after its step.

PD disaggregation: a sequence placed on a `decode` group also gets a slot and blocks of a `prefill`
group and a transfer ticket. Its whole prompt is computed there (the prefill group's prefix cache
helping) and sent to the decode slot's blocks, outside the plan's order (decode steps never wait for
it); `transferred()` or `transfer_failed()` reports the outcome. Until then it is not decoded and
its decode blocks are never preempted. A sequence that ends before its KV arrived releases its
decode slot with the ticket, which the decode group then refuses should the KV still come.
"""

from __future__ import annotations

import random
from collections import Counter, deque
from collections.abc import Collection, Mapping

from agent.contract.sampling import Sampled
from agent.contract.step import Proposal, proposal_size
from scheduler.block_manager import BlockManager
from scheduler.client_share import ClientShares
from scheduler.engine_io import AdmissionError, FaultKind, Refusal
from scheduler.engine_stats import EngineStats, GroupStats, KvBlockStats
from scheduler.placement import Placement
from scheduler.plan import Chunk, GroupCapacity, Release, StepPlan, attended
from scheduler.sequence import FinishReason, Sequence, SequenceStatus
from scheduler.speculation.drafts import Drafts
from scheduler.speculation.speculator import Speculator
from scheduler.speculation.verify_costs import VerifyCosts
from scheduler.step_costs import StepCosts


class BatchScheduler:
    def __init__(
        self,
        groups: list[GroupCapacity],
        max_waiting: int,
        max_prefills_per_step: int = 16,
        max_tokens_in_flight: int | None = None,
        max_batched_tokens: int = 512,
        enable_prefix_caching: bool = True,
        decode_stall_ratio: float = 0.0,
        clients: ClientShares | None = None,
        speculator: Speculator | None = None,
    ):
        self.max_waiting = max_waiting
        self.max_prefills_per_step = max_prefills_per_step  # admissions per step
        # Bound on prompt + answer tokens of every admitted request (waiting and running).
        self.max_tokens_in_flight = max_tokens_in_flight
        self.max_batched_tokens = max_batched_tokens  # positions one group's step computes
        # Each group's learned step costs: how many prompt positions may join its decode rows.
        self.step_costs = [StepCosts(decode_stall_ratio, g.block_size) for g in groups]
        # Each group's learned cost of verifying proposals: how many pay (scheduler/speculation/drafts.py).
        self.verify_costs = [VerifyCosts() for _ in groups]
        self.tokens_in_flight = 0
        self.placement = Placement(groups, enable_prefix_caching)  # slots, blocks, health
        self.waiting: deque[Sequence] = deque()
        self.running: dict[str, Sequence] = {}  # admission order: the newest is preempted first
        self.pending_releases: list[Release] = []
        self.preemptions = 0  # cumulative, for the metrics
        self.drafts = Drafts(speculator)  # speculative decoding's proposals and their counts
        self.clients = clients or ClientShares()  # what each client holds; the fair admission order

    # The groups' state, kept by the placement (the lists are its own: changed in place).
    @property
    def groups(self) -> list[GroupCapacity]:
        return self.placement.groups

    @property
    def blocks(self) -> list[BlockManager]:
        return self.placement.blocks

    @property
    def free_slots(self) -> list[list[int]]:
        return self.placement.free_slots

    @property
    def healthy(self) -> list[bool]:
        return self.placement.healthy

    @property
    def can_serve(self) -> bool:
        """Some healthy group decodes, and gets prompts (prefills them itself or has a prefill group)."""
        return self.placement.can_serve

    # ------------------------------------------------------------------------------- requests

    def add(self, seq: Sequence) -> None:
        if not seq.prompt:
            raise AdmissionError("the prompt is empty", Refusal.EMPTY_PROMPT)
        if not self.can_serve:
            raise AdmissionError(
                "no agent is available (every agent failed; waiting for it to come back)", Refusal.NO_GROUP
            )
        longest = self.placement.longest_prompt()
        if len(seq.prompt) > longest:
            raise AdmissionError(
                f"the prompt has {len(seq.prompt)} tokens; the longest accepted is {longest}",
                Refusal.TOO_LONG,
            )
        # Requests a free slot will take on the next iteration do not count as waiting: a burst
        # that arrives between two iterations must not be refused while slots are idle.
        free = self.placement.free_seats()
        # Generation stops at the last position, so no request holds more than max_seq_len.
        seq.token_budget = min(len(seq.prompt) + seq.max_new_tokens, self.placement.longest_sequence())
        limit = self.max_tokens_in_flight
        refused = self.clients.refusal(
            seq,
            (len(self.waiting), self.max_waiting + free),
            None if limit is None else (self.tokens_in_flight, limit),
        )
        if refused is not None:
            message, over_share = refused
            raise AdmissionError(message, Refusal.CLIENT_LIMIT if over_share else Refusal.OVERLOADED)
        self.tokens_in_flight += seq.token_budget
        self.clients.queued(seq)
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

    def stats(self, agents: list[tuple[str, ...]], releasing: Mapping[int, int]) -> EngineStats:
        """The state now: agents, each group's addresses; releasing, each group's releases sent to
        its agent and not answered yet (the executor's)."""
        running = Counter(seq.group for seq in self.running.values())
        planned = Counter(release.group for release in self.pending_releases)
        groups = tuple(
            GroupStats(
                group=g,
                agents=agents[g],
                role=capacity.role,
                healthy=self.healthy[g],
                seats=capacity.seats,
                max_prompt_len=capacity.max_prompt_len,
                max_seq_len=capacity.max_seq_len,
                running=running[g],
                releases_pending=planned[g] + releasing.get(g, 0),
                kv_blocks=KvBlockStats(
                    block_size=blocks.block_size,
                    total=blocks.num_blocks,
                    used=blocks.num_used,
                    free=blocks.num_free,
                    cached=blocks.num_cached,
                    prefix_caching=blocks.enable_prefix_caching,
                ),
            )
            for g, (capacity, blocks) in enumerate(zip(self.groups, self.blocks))
        )
        return EngineStats(
            started=True,
            running=self.num_running,
            waiting=self.num_waiting,
            tokens_in_flight=self.tokens_in_flight,
            groups=groups,
        )

    # -------------------------------------------------------------------------------- planning

    def schedule(self, busy: Collection[int] = ()) -> StepPlan:
        """The next plan, leaving out the `busy` groups (their step is still in flight): their
        releases stay pending, nothing is placed on them, none of theirs runs."""
        plan = StepPlan(releases=[r for r in self.pending_releases if r.group not in busy])
        self.pending_releases = [r for r in self.pending_releases if r.group in busy]
        for release in plan.releases:  # released before this plan's prefills run
            self.placement.free_slot(release.group, release.slot)
        open_groups = [g for g in range(len(self.groups)) if self.healthy[g] and g not in busy]
        starved: set[int] = set()  # groups where a placed sequence waits for blocks: admit none
        for group in open_groups:
            decodes = self._plan_decodes(group)
            if decodes:
                plan.decodes[group] = decodes
            if not self._restore_preempted(group):
                starved.add(group)
            elif decodes:
                costs = self.verify_costs[group]
                self.drafts.plan(self.groups[group], self.blocks[group], decodes, plan, costs)
        admitted, admissible = 0, [g for g in open_groups if g not in starved]
        while self.waiting and admitted < self.max_prefills_per_step:
            seq = self.clients.next_to_admit(self.waiting)
            if seq is None or not self._admit(seq, admissible, plan):
                break
            self.waiting.remove(seq)
            admitted += 1
        for group in open_groups:
            decodes = plan.decodes.get(group, [])
            self._plan_prompts(group, self._prompt_budget(group, decodes, plan.proposed(decodes)), plan)
        return plan

    def _prompt_budget(self, group: int, decodes: list[Sequence], proposed: int) -> int:
        """Prompt positions a step of the `decodes` rows (and the `proposed` tokens after them) may
        carry: what the token budget leaves, within one mixed call's rows, and no more than the
        group's step costs allow for the prompts waiting (a stream waits for the step); never below
        the costs' floor, so prompts advance beside any batch."""
        if not decodes:
            return self.max_batched_tokens
        capacity, costs = self.groups[group], self.step_costs[group]
        budget = self.max_batched_tokens - len(decodes) - proposed
        if capacity.mixed_rows:
            budget = min(budget, max(capacity.limits.prompt_rows(len(decodes), proposed), costs.floor))
        # Prompts without a first token: the group's placed ones and the queue not yet placed.
        pending = [s for s in self._group_seqs(group) if s.needs_prefill and not s.transferring]
        allowed = costs.prompt_positions(
            len(decodes),
            attended(decodes),
            waiting=len(self.waiting) + len(pending),
            start=max((s.computed for s in pending), default=0),  # the costliest chunk's, to be safe
        )
        return budget if allowed is None else min(budget, allowed)

    def _group_seqs(self, group: int) -> list[Sequence]:
        return [s for s in self.running.values() if s.group == group]

    def _plan_decodes(self, group: int) -> list[Sequence]:
        """Every sequence of the group with its KV complete, each with a block for its next
        position; where none is free, the newest sequence holding blocks is preempted."""
        blocks = self.blocks[group]
        decodes = []
        for seq in self._group_seqs(group):
            if seq.transferring or seq.needs_prefill or seq.request_id not in blocks:
                continue
            while not blocks.append(seq.request_id, seq.computed + 1):
                victim = next(
                    s
                    for s in reversed(self._group_seqs(group))
                    if s.request_id in blocks and not s.transferring
                )
                self._preempt(victim)
                if victim is seq:
                    break
            else:
                decodes.append(seq)
        return [s for s in decodes if s.request_id in blocks]  # a later row's append took its blocks

    def _preempt(self, seq: Sequence) -> None:
        """Its blocks go to others; it keeps its slot, tokens and sampling state and is recomputed."""
        self.blocks[seq.placement[0]].free(seq.request_id)
        seq.slot_holds, seq.computed = seq.computed, 0
        seq.preemptions += 1
        self.preemptions += 1

    def tier_restore_failed(
        self, group: int, digests: list[str], restores: list[tuple[str, int]]
    ) -> list[Sequence]:
        """The group's agent lacked these digests of the step's `restores` (the tier lost them): they
        are never looked up again, and each sequence holding such a block (KV never written) is
        preempted, to be recomputed from that block on, none of the garbage ever registered.
        Returns those sequences: their agent slots must be released (a chunk of the failed step
        may have sampled from the garbage), then they start again as fresh prompts do."""
        blocks = self.blocks[group]
        blocks.restore_failed(digests)
        lost = set(digests)
        failed = {block for digest, block in restores if digest in lost}
        preempted = []
        for seq in self._group_seqs(group):
            if seq.request_id not in blocks:
                continue
            table = blocks.table(seq.request_id)
            first = min((i for i, block in enumerate(table) if block in failed), default=None)
            if first is not None:
                self._preempt(seq)
                seq.slot_holds = min(seq.slot_holds, first * blocks.block_size)
                preempted.append(seq)
        return preempted

    def _restore_preempted(self, group: int) -> bool:
        """Blocks again for the group's preempted sequences, oldest first, the prefix cache giving
        back what it still holds; False when one of them waits for blocks."""
        capacity, blocks = self.groups[group], self.blocks[group]
        for seq in self._group_seqs(group):
            if seq.needs_prefill and not seq.transferring and seq.request_id not in blocks:
                tokens = seq.tokens(seq.positions_used)
                hit = self.placement.allocate(group, seq, tokens, max_hit=seq.slot_holds)
                if hit is None:
                    return False
                seq.computed = hit if capacity.chunked_prefill else 0
        return True

    def _plan_prompts(self, group: int, budget: int, plan: StepPlan) -> None:
        """Chunks of the group's placed sequences whose KV is incomplete, within `budget` positions:
        recomputes of preempted sequences first (their streams are paused), then the prompts with
        the fewest positions left (a short prompt's first token does not wait for the whole of a long
        one), the oldest prompt always keeping a few positions of the step so that none starves."""
        blocks = self.blocks[group]
        pending = [
            s
            for s in self._group_seqs(group)
            if s.needs_prefill and not s.transferring and s.request_id in blocks
        ]
        recomputes = [s for s in pending if s.output]
        prompts = [s for s in pending if not s.output]
        oldest = prompts[0] if prompts else None
        reserve = min(self.step_costs[group].floor, oldest.positions_left) if oldest else 0
        for seq in recomputes + sorted(prompts, key=lambda s: s.positions_left):
            if seq is oldest:
                reserve = 0
            budget -= self._plan_chunk(seq, budget - reserve, plan)

    def _plan_chunk(self, seq: Sequence, budget: int, plan: StepPlan) -> int:
        """Plan the sequence's next chunk within `budget` positions -> the positions it takes."""
        capacity = self.groups[seq.placement[0]]
        if capacity.chunked_prefill:
            size = min(seq.positions_left, budget, capacity.max_chunk)
        else:  # one call computes it all, whatever the budget says
            size = seq.positions_left if budget > 0 else 0
        if size <= 0:
            return 0
        end = seq.computed + size
        plan.prefills.append(
            Chunk(seq, seq.computed, end, sample=end == seq.positions_used and not seq.output)
        )
        return size

    def _admit(self, seq: Sequence, groups: list[int], plan: StepPlan) -> bool:
        """Place the head of the queue with its blocks (its chunks are planned with the group's other
        prompts), or plan its prefill elsewhere; False when no group has room now."""
        placement = self.placement.place(seq, groups)
        if placement is None:
            return False
        group, prefill_group = placement
        seq.group, seq.slot = group, self.free_slots[group].pop(0)
        hit = self.placement.allocate(group, seq, seq.prompt)
        assert hit is not None, "place() checked the blocks"
        seq.status = SequenceStatus.RUNNING
        self.clients.admitted(seq)
        self.running[seq.request_id] = seq
        if prefill_group is None:
            seq.computed = hit
            return True
        seq.prefill_group, seq.prefill_slot = prefill_group, self.free_slots[prefill_group].pop(0)
        prefill_hit = self.placement.allocate(prefill_group, seq, seq.prompt)
        assert prefill_hit is not None, "place() checked the prefill group's blocks"
        seq.ticket, seq.transferring = random.getrandbits(62), True
        plan.prefills.append(Chunk(seq, prefill_hit, len(seq.prompt), sample=True))
        return True

    # ------------------------------------------------------------------------------- results

    def prefilled(self, chunk: Chunk, token: Sampled | None) -> None:
        """A chunk ran: its positions hold KV (full blocks join the prefix cache); the last chunk
        of a prompt brings its first token."""
        seq = chunk.seq
        if seq.finished:  # aborted while its prefill was in flight
            return
        seq.computed = chunk.end
        self.blocks[seq.placement[0]].computed(seq.request_id, seq.tokens(chunk.end), chunk.end)
        if chunk.sample:
            assert token is not None, "a prompt's last chunk samples a token"
            self._append(seq, token)

    def transferred(self, seq: Sequence, token: Sampled) -> None:
        """Its prefill group sent the KV and the decode group took it: it decodes from now on."""
        self.placement.free_prefill_slot(seq, computed=True)
        seq.transferring = False
        if not seq.finished:  # aborted meanwhile: its decode slot is already being released
            seq.computed = len(seq.prompt)
            self._append(seq, token)

    def transfer_failed(self, seq: Sequence, error: str) -> None:
        self.placement.free_prefill_slot(seq, computed=False)
        if not seq.finished:
            seq.error = error
            self._finish(seq, FinishReason.ERROR)

    def decoded(
        self, seqs: list[Sequence], tokens: list[list[Sampled]], drafts: dict[str, Proposal] | None = None
    ) -> None:
        """Each sequence's tokens of a decode step: one, or with proposals (`drafts`) the ones
        its agent kept and one more. The KV of its pending token and of the proposals kept is
        written; the blocks taken for the proposals not kept go back."""
        drafts = drafts or {}
        for seq, sampled in zip(seqs, tokens):
            if seq.finished:  # aborted while its step was in flight
                continue
            proposed = proposal_size(drafts.get(seq.request_id, []))
            blocks = self.blocks[seq.placement[0]]
            before = seq.computed
            seq.computed += len(sampled)  # the pending token's KV and the kept proposals'
            if seq.computed // blocks.block_size > before // blocks.block_size:  # blocks filled: cached
                written = seq.tokens(len(seq.prompt) + len(seq.output)) + [s.token for s in sampled]
                blocks.computed(seq.request_id, written, seq.computed)
            if proposed:
                self.drafts.verified(seq, proposed, len(sampled) - 1)
            for token in sampled:
                self._append(seq, token)
                if seq.finished:  # a stop among the kept tokens: the ones after it are not the answer
                    break
            if proposed and not seq.finished:
                blocks.truncate(seq.request_id, seq.computed + 1)

    def drop_drafts(self, seqs: list[Sequence], drafts: dict[str, Proposal]) -> None:
        """The sequences decode without their proposals: the blocks taken for them go back."""
        for seq in seqs:
            if seq.request_id in drafts and not seq.finished:
                self.blocks[seq.placement[0]].truncate(seq.request_id, seq.computed + 1)

    def finish(self, seq: Sequence, reason: FinishReason) -> None:
        """Finish from outside the token rules (a stop string found in the text)."""
        if not seq.finished:
            self._finish(seq, reason)

    def group_failed(self, group: int, error: str) -> list[Sequence]:
        """The group is unusable: fail its sequences; its slots and blocks are forgotten until it
        returns."""
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
        self.placement.failed(group)
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
        self.placement.recovered(group, capacity)

    def _append(self, seq: Sequence, sampled: Sampled) -> None:
        if sampled.fault is not None:  # this sequence's own error: it ends, the step went on
            seq.error, seq.fault = sampled.fault.message, FaultKind(sampled.fault.kind)
            self._finish(seq, FinishReason.ERROR)
            return
        token = sampled.token
        seq.output.append(token)
        if sampled.logprob is not None:
            seq.logprobs.append(sampled.logprob)
        if seq.constraint is not None and token not in seq.stop_ids:
            try:
                seq.constraint.advance(token)
            except ValueError as exc:  # the agent chose outside the mask it was sent: a bug
                seq.error, seq.fault = f"structured output: {exc}", FaultKind.INTERNAL
                self._finish(seq, FinishReason.ERROR)
                return
            if seq.constraint.complete:  # nothing may follow: ended as by EOS, one step sooner
                self._finish(seq, FinishReason.STOP)
                return
        if token in seq.stop_ids:
            self._finish(seq, FinishReason.STOP)
        elif len(seq.output) >= seq.max_new_tokens:
            self._finish(seq, FinishReason.LENGTH)
        elif seq.positions_used >= self.groups[seq.placement[0]].max_seq_len:
            self._finish(seq, FinishReason.LENGTH)  # no position left to write the pending token

    def _finish(self, seq: Sequence, reason: FinishReason, release: bool = True) -> None:
        if seq.finished:  # once only: its tokens leave tokens_in_flight once
            return
        self.clients.finished(seq, was_running=seq.status is SequenceStatus.RUNNING)
        seq.status, seq.finish_reason = SequenceStatus.FINISHED, reason
        self.tokens_in_flight -= seq.token_budget
        if self.running.pop(seq.request_id, None) is not None and release:
            group, slot = seq.placement  # it ran, so it was placed
            self.blocks[group].free(seq.request_id)
            self.pending_releases.append(Release(group, slot, seq.ticket if seq.transferring else None))
