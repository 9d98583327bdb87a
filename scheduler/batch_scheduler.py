"""BatchScheduler: continuous batching of sequences over the groups' paged KV caches. Pure logic:
no sockets, no asyncio; the engine loop (scheduler/engine.py) asks it for a plan, runs the plan on
the groups and reports the results back. A group is one model instance: one agent, or the agents of
a tensor-parallel group, which the scheduler sees as one.

    plan = scheduler.schedule()     # releases, decodes, then prompt chunks within the token budget
    plan = scheduler.schedule(busy={1})   # the same, leaving out groups whose step is in flight
    ... each of plan.parts runs (its releases, then its agent steps), each of plan.transfers too ...
    outputs = scheduler.update(outcomes)  # what the calls came to -> each touched request's news
    outputs = scheduler.finish_requests(["r1"], FinishReason.ABORT)   # the client is gone

A plan is final: which calls it makes (a group's decode and its prompt chunks in one mixed call
where they fit, each alone where not, or where the agent refused the last mixed call), their
requests (scheduler/step_requests.py), block tables and tier moves. The outcomes (StepOutcome) are
the only way results come back: tokens, prompt scores, failures, a lost group, the step and
verification costs; constraints (grammars, thinking budgets) advance here, token by token, as the
tokens are appended (vLLM's update_from_output).

The plan's parts are in scheduler/plan.py; the groups' slots, blocks and health, and where a new
sequence goes, in scheduler/placement.py; speculative decoding's proposals in scheduler/speculation/drafts.py;
what each client may hold (fair share) in scheduler/client_share.py.

Each step of a group spends at most `max_batched_tokens` positions: every decode row first (a
decode never waits for a prompt), then prompt chunks, oldest first: a long prompt spans several
steps, short ones share one. Pooling requests' inputs (embeddings, scores: batch work) come after
the streams' prompts, bounded on their own beside decode rows (`pooling_stall_ratio`), and without
decode rows to what fits one call. A prompt reuses the longest cached run of full blocks with the
same prefix (prefix caching) and computes the rest. When a decode needs a block and none is free,
the most recently admitted sequence of the group is preempted: its blocks go, it keeps its slot and
its tokens, and it is recomputed (a prompt chunk) before new admissions, losing nothing.

A finished sequence's slot goes into the next plan's releases, and only that plan may give it to a
waiting sequence: the release runs first, so a slot is never prefilled while the group still holds
the previous sequence, and the next request enters on the very next iteration. Its blocks are free
at once: a group's blocks are handed out only by a plan for that group, which runs after its step.

PD disaggregation: a sequence placed on a `decode` group also gets a slot and blocks of a `prefill`
group and a transfer ticket. Its whole prompt is computed there (the prefill group's prefix cache
helping) and sent to the decode slot's blocks, outside the plan's order (decode steps never wait for
it); its outcome comes back through update() as any call's does. Until then it is not decoded and
its decode blocks are never preempted. A sequence that ends before its KV arrived releases its
decode slot with the ticket, which the decode group then refuses should the KV still come.
"""

from __future__ import annotations

import random
import time
from collections import Counter, deque
from collections.abc import Collection, Iterable, Mapping
from dataclasses import replace

from agent.contract.sampling import Sampled
from agent.contract.step import Proposal, proposal_size
from agent.contract.step_reply import StepReply
from scheduler.block_manager import BlockManager
from scheduler.client_share import ClientShares
from scheduler.engine_io import AdmissionError, EngineOutput, FaultKind, Refusal
from scheduler.engine_stats import EngineCounts, EngineStats, GroupStats, KvBlockStats, StateStats
from scheduler.placement import Placement
from scheduler.plan import (
    Chunk,
    Failure,
    GroupCapacity,
    KVDestination,
    PlannedStep,
    PromptBudget,
    Release,
    StepOutcome,
    StepPlan,
    attended,
)
from scheduler.sequence import FinishReason, Sequence, SequenceStatus
from scheduler.speculation.drafts import Drafts
from scheduler.speculation.speculator import Speculator
from scheduler.speculation.verify_costs import VerifyCosts
from scheduler.step_costs import StepCosts
from scheduler.step_requests import scores, step_request, transfer_request
from scheduler.timeline import AgentCall


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
        pooling_stall_ratio: float = 0.0,
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
        # ... and how many of them pooling requests' (0: as many as the prompts may take)
        self.pooling_stall_ratio = pooling_stall_ratio
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
        # groups whose agent refused a mixed step: their next step runs its parts alone
        self._split: set[int] = set()

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
        free = self.placement.free_slot_count()
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

    def finish_requests(self, request_ids: Iterable[str], reason: FinishReason) -> list[EngineOutput]:
        """End these requests, waiting or running (the client is gone: ABORT; a stop string in
        their text: STOP); their slots are released by the next plan. Their final outputs."""
        ids = set(request_ids)
        ended = [seq for seq in self.waiting if seq.request_id in ids]
        for seq in ended:
            self.waiting.remove(seq)
        ended += [self.running[rid] for rid in ids if rid in self.running]
        for seq in ended:
            self._finish(seq, reason)
        return self._reports(ended)

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
                usable_slots=capacity.usable_slots,
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
                states=None
                if snapshots is None
                else StateStats(snapshots=snapshots.slots, held=snapshots.held),
            )
            for g, (capacity, blocks, snapshots) in enumerate(
                zip(self.groups, self.blocks, self.placement.snapshots)
            )
        )
        return EngineStats(
            started=True,
            running=self.num_running,
            waiting=self.num_waiting,
            tokens_in_flight=self.tokens_in_flight,
            groups=groups,
            counts=self.counts(),
        )

    def counts(self) -> EngineCounts:
        """The totals since the start (the metrics' counters), without the rest of stats()."""
        return EngineCounts(
            preemptions=self.preemptions,
            prefix_query_tokens=self.placement.prefix_query_tokens,
            prefix_hit_tokens=self.placement.prefix_hit_tokens,
            prefix_tier_hit_tokens=self.placement.prefix_tier_hit_tokens,
            state_restores=sum(s.restored for s in self.placement.snapshots if s is not None),
            proposed_tokens=self.drafts.proposed_tokens,
            accepted_tokens=self.drafts.accepted_tokens,
            speculative_steps=self.drafts.speculative_steps,
        )

    def drop_cache(self, group: int) -> tuple[int, bool]:
        """Forget the group's cached prefixes: how many pool blocks held one, and whether its agent
        keeps a KV tier to empty too."""
        blocks = self.blocks[group]
        return blocks.drop_cache(), blocks.tiered

    # -------------------------------------------------------------------------------- planning

    def schedule(self, busy: Collection[int] = ()) -> StepPlan:
        """The next plan, leaving out the `busy` groups (their step is still in flight): their
        releases stay pending, nothing is placed on them, none of theirs runs."""
        plan = StepPlan(releases=[r for r in self.pending_releases if r.group not in busy])
        self.pending_releases = [r for r in self.pending_releases if r.group in busy]
        for release in plan.releases:  # released before this plan's prefills run
            plan.part(release.group).releases.append(release)
            if not release.keep:
                self.placement.free_slot(release.group, release.slot)
        open_groups = [g for g in range(len(self.groups)) if self.healthy[g] and g not in busy]
        starved: set[int] = set()  # groups where a placed sequence waits for blocks: admit none
        for group in open_groups:
            decodes = self._plan_decodes(group)
            if decodes:
                plan.decodes[group] = decodes
            if not self._restore_preempted(group):
                starved.add(group)
            elif decodes and group not in self._split:
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
            plan.part(group).steps.extend(self._group_steps(group, plan))
        plan.transfers = [self._transfer_step(c) for c in plan.prefills if c.seq.transferring]
        plan.parts = {g: part for g, part in plan.parts.items() if part.releases or part.steps}
        return plan

    def _group_steps(self, group: int, plan: StepPlan) -> list[PlannedStep]:
        """The group's agent calls: its decode rows (with their proposals) and its own prompt
        chunks in one mixed call where they fit (several chunks without decode rows too), then
        each chunk left alone (one that scores its
        prompt positions always is); everything alone after the agent refused a mixed call."""
        split = group in self._split
        self._split.discard(group)
        decodes = plan.decodes.get(group, [])
        chunks = [c for c in plan.prefills if c.seq.placement[0] == group and not c.seq.transferring]
        local = [c for c in chunks if not scores(c)]
        drafts = {s.request_id: plan.drafts[s.request_id] for s in decodes if s.request_id in plan.drafts}
        mixes = self.groups[group].mixes
        proposed = plan.proposed(decodes)
        together = local if not split and mixes(len(decodes), local, proposed) else []
        if not decodes and not split and not together:  # the chunks that fit one call, in order
            for chunk in local:
                trial = [*together, chunk]
                if self.groups[group].limits.fits(
                    0, 0, [c.end - c.start for c in trial], sum(c.sample for c in trial)
                ):
                    together.append(chunk)
            together = together if mixes(0, together) else []
        steps = []
        if decodes:
            if split or not mixes(len(decodes), together, proposed):  # the proposals go unverified
                self._drop_drafts(decodes, drafts)
                drafts = {}
                for seq in decodes:
                    plan.drafts.pop(seq.request_id, None)
            steps.append(self._planned(group, decodes, together, drafts, tier_moves=True))
        elif together:
            steps.append(self._planned(group, [], together, {}, tier_moves=True))
        for chunk in chunks:
            if not any(chunk is c for c in together):
                steps.append(self._planned(group, [], [chunk], {}, tier_moves=not steps))
        return steps

    def _planned(
        self,
        group: int,
        decodes: list[Sequence],
        chunks: list[Chunk],
        drafts: Mapping[str, Proposal],
        tier_moves: bool,
    ) -> PlannedStep:
        request = step_request(self.blocks[group], decodes, chunks, drafts, tier_moves)
        return PlannedStep(
            group=group,
            request=request,
            decodes=tuple(decodes),
            chunks=tuple(chunks),
            drafts=drafts,
            attending=attended(decodes),
        )

    def _transfer_step(self, chunk: Chunk) -> PlannedStep:
        """PD disaggregation: the prompt computed on its prefill group, its KV sent to the decode
        group's slot and blocks under the sequence's ticket."""
        seq = chunk.seq
        (prefill_group, _), (group, slot) = seq.prefill_placement, seq.placement
        assert seq.ticket is not None  # given when the transfer was planned
        table = tuple(self.blocks[group].table(seq.request_id))
        return PlannedStep(
            group=prefill_group,
            request=transfer_request(self.blocks[prefill_group], chunk),
            send_to=KVDestination(group, slot, seq.ticket, table),
            chunks=(chunk,),
        )

    def _prompt_budget(self, group: int, decodes: list[Sequence], proposed: int) -> PromptBudget:
        """Prompt positions a step of the `decodes` rows (and the `proposed` tokens after them) may
        carry: what the token budget leaves, within one mixed call's rows, and no more than the
        group's step costs allow for the prompts waiting (a stream waits for the step); never below
        the costs' floor, so prompts advance beside any batch. Of those, pooling requests' take no
        more than the costs allow at `pooling_stall_ratio` (at least one: the job advances), and
        none in a step the costs want to see decode alone."""
        if not decodes:
            return PromptBudget(self.max_batched_tokens, self.max_batched_tokens)
        capacity, costs = self.groups[group], self.step_costs[group]
        budget = self.max_batched_tokens - len(decodes) - proposed
        if capacity.mixed_rows:
            budget = min(budget, max(capacity.limits.prompt_rows(len(decodes), proposed), costs.floor))
        # Prompts without a first token: the group's placed ones and the queue not yet placed. Only
        # a stream's weighs (a pooling request's prompt is batch work that never decodes: an
        # embedding job's thousand inputs must not stall the streams decoding beside it).
        pending = [s for s in self._group_seqs(group) if s.needs_prefill and not s.transferring]
        streams = sum(s.sampling.pool is None for s in (*self.waiting, *pending))
        allowed = costs.prompt_positions(
            len(decodes),
            attended(decodes),
            waiting=streams,
            start=max((s.computed for s in pending), default=0),  # the costliest chunk's, to be safe
        )
        budget = budget if allowed is None else min(budget, allowed)
        if not self.pooling_stall_ratio:
            return PromptBudget(budget, budget)
        if costs.wants_decode_step:
            return PromptBudget(budget, 0)
        pooled = costs.prompt_positions(
            len(decodes),
            attended(decodes),
            start=max((s.computed for s in pending if s.sampling.pool is not None), default=0),
            ratio=self.pooling_stall_ratio,
            floor=1,
        )
        return PromptBudget(budget, budget if pooled is None else min(budget, pooled))

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
        self.placement.drop_states(seq)
        self.blocks[seq.placement[0]].free(seq.request_id)
        seq.slot_holds, seq.computed = seq.computed, 0
        seq.preemptions += 1
        self.preemptions += 1

    def _tier_restore_failed(
        self, group: int, digests: list[str], restores: Iterable[tuple[str, int]]
    ) -> None:
        """The group's agent lacked these digests of the step's `restores` (the tier lost them): they
        are never looked up again, and each sequence holding such a block (KV never written) is
        preempted, to be recomputed from that block on, none of the garbage ever registered. Its
        agent slot is reset first (a chunk of the failed step may have sampled from the garbage):
        the next plan releases it, the sequence keeping it."""
        blocks = self.blocks[group]
        blocks.restore_failed(digests)
        lost = set(digests)
        failed = {block for digest, block in restores if digest in lost}
        for seq in self._group_seqs(group):
            if seq.request_id not in blocks:
                continue
            table = blocks.table(seq.request_id)
            first = min((i for i, block in enumerate(table) if block in failed), default=None)
            if first is not None:
                self._preempt(seq)
                seq.slot_holds = min(seq.slot_holds, first * blocks.block_size)
                self.pending_releases.append(Release(group, seq.placement[1], keep=True))

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

    def _plan_prompts(self, group: int, budget: PromptBudget, plan: StepPlan) -> None:
        """Chunks of the group's placed sequences whose KV is incomplete, within `budget`:
        recomputes of preempted sequences first (their streams are paused), then the prompts of
        streams, the fewest positions left first (a short prompt's first token does not wait for
        the whole of a long one), the oldest keeping a few positions of the step so that none
        starves; then pooling requests' in their order (batch work: an embedding job's inputs do
        not delay a chat's first token), in a step without decode rows only where they fit one
        call with the chunks before them (a chat arriving meanwhile waits for one call, not for
        the job's queue of them)."""
        blocks = self.blocks[group]
        pending = [
            s
            for s in self._group_seqs(group)
            if s.needs_prefill and not s.transferring and s.request_id in blocks
        ]
        recomputes = [s for s in pending if s.output]
        streams = [s for s in pending if not s.output and s.sampling.pool is None]
        oldest = streams[0] if streams else None
        reserve = min(self.step_costs[group].floor, oldest.positions_left) if oldest else 0
        positions, pooling = budget
        call: list[Chunk] | None = None if plan.decodes.get(group) else []
        for seq in (
            recomputes
            + sorted(streams, key=lambda s: s.positions_left)
            + [s for s in pending if not s.output and s.sampling.pool is not None]
        ):
            if seq is oldest:
                reserve = 0
            if seq.sampling.pool is None:
                limit = positions - reserve
            else:
                limit = min(positions, pooling, self._room_beside(seq, call) if call else positions)
            planned = len(plan.prefills)
            taken = self._plan_chunk(seq, limit, plan)
            positions -= taken
            pooling -= taken if seq.sampling.pool is not None else 0
            if call is not None and len(plan.prefills) > planned:
                call.append(plan.prefills[-1])

    def _room_beside(self, seq: Sequence, call: list[Chunk]) -> int:
        """Positions of the sequence's next chunk that still fit one call with the `call` chunks
        (0 where none do, or where its whole prompt would not when it cannot be chunked)."""
        capacity = self.groups[seq.placement[0]]
        rows = [c.end - c.start for c in call]
        sampled = sum(c.sample for c in call)
        if (
            seq.scoring_prompt
            or any(scores(c) for c in call)
            or not capacity.limits.fits(0, 0, [*rows, 1], sampled + 1)
        ):
            return 0  # a chunk that scores its prompt positions runs alone
        room = capacity.limits.prompt_rows(0, 0) - sum(rows)
        return room if capacity.chunked_prefill or seq.positions_left <= room else 0

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
        restore, save = seq.state_restore, None
        snapshots = self.placement.snapshots[seq.placement[0]]
        saves = [p for p in seq.state_saves if seq.computed < p <= end]
        if saves and snapshots is not None:  # the chunk ends where its state is saved
            save = snapshots.take()
            end = saves[0] if save is not None else end
            size = end - seq.computed
        plan.prefills.append(
            Chunk(seq, seq.computed, end, end == seq.positions_used and not seq.output, restore, save)
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

    def update(self, outcomes: Iterable[StepOutcome]) -> list[EngineOutput]:
        """What a plan's calls came to, in the order they ran -> what each request they touched
        has new (its tokens, its end)."""
        touched: dict[str, Sequence] = {}
        for outcome in outcomes:
            for seq in self._take(outcome):
                touched[seq.request_id] = seq
        return self._reports(touched.values())

    def _take(self, outcome: StepOutcome) -> list[Sequence]:
        """One call's outcome into the sequences and the groups -> the sequences it touched; the
        state snapshots its chunks were to save that did not run go back."""
        touched = self._take_outcome(outcome)
        snapshots = self.placement.snapshots[outcome.group]
        if snapshots is not None and isinstance(outcome.part, PlannedStep):
            for chunk in outcome.part.chunks:
                if chunk.save is not None:
                    snapshots.release(chunk.save)  # no-op where it was saved
        return touched

    def _take_outcome(self, outcome: StepOutcome) -> list[Sequence]:
        lost, step = outcome.group_failure, outcome.part
        if lost is not None:
            failed = self._group_failed(outcome.group, f"agent {outcome.agent} failed: {lost}")
            if isinstance(step, PlannedStep) and step.send_to is not None:
                failed += self._transfer_failed(step.chunks[0].seq, str(lost))
            return failed
        if isinstance(step, Release):
            return []
        if outcome.failure is Failure.REFUSED:
            return self._refused(step, str(outcome.error))
        if outcome.failure is Failure.INTERNAL:
            error = f"internal error: {type(outcome.error).__name__}: {outcome.error}"
            if step.send_to is not None:
                return self._transfer_failed(step.chunks[0].seq, error)
            return self._fail([*step.decodes, *(c.seq for c in step.chunks)], error)
        reply = outcome.reply
        assert reply is not None, "a call either answered or failed"
        self._learn(outcome, step)
        self._timed(step, outcome.call)
        if reply.tier is not None:  # the index holds only what the tier does
            self.blocks[step.group].tier_evicted(reply.tier.evicted_keys)
        if reply.restore_failed:
            self._tier_restore_failed(step.group, list(reply.restore_failed), step.request.restore)
        if step.send_to is not None:
            return self._transferred(step.chunks[0], reply)
        return self._decoded(step, reply) + self._prefilled(step, reply)

    def _refused(self, step: PlannedStep, error: str) -> list[Sequence]:
        """The agent refused the call as a bad request (nothing of it ran; the group is fine): a
        mixed call's parts run alone next, so that only the bad one fails; a chunk alone fails its
        sequence. Its tier moves go with the group's next call."""
        if step.send_to is not None:
            return self._transfer_failed(step.chunks[0].seq, error)
        blocks = self.blocks[step.group]
        blocks.spills[:0], blocks.restores[:0] = step.request.spill, step.request.restore
        if step.mixed:
            self._split.add(step.group)
            self._drop_drafts(list(step.decodes), step.drafts)
            return []
        return self._fail([c.seq for c in step.chunks], error)

    def _learn(self, outcome: StepOutcome, step: PlannedStep) -> None:
        """A decode's cost into the group's step costs; a decode alone (plain or verifying
        proposals) into what proposals cost."""
        if not step.decodes:
            return
        decodes, costs = len(step.decodes), self.step_costs[step.group]
        if step.mixed:
            costs.mixed(decodes, step.attending, [(c.start, c.end) for c in step.chunks], outcome.compute_s)
        else:
            costs.decoded(decodes, step.attending, outcome.compute_s)
        if not step.chunks and outcome.call is not None:
            # Timed as the scheduler waits for it: a step's tokens cost the whole round trip
            # (ZeroMQ, (de)serialising: ~0.7 ms of the default model's 7.3 ms step), and with the
            # agent's compute alone the proposal lengths undervalued each step's extra tokens
            # (copy-heavy work at 1 stream, 1.35x against 1.49x for 4 proposals every step).
            proposed = sum(proposal_size(p) for p in step.drafts.values())
            round_trip = outcome.call.end - outcome.call.start
            self.verify_costs[step.group].sampled(decodes, proposed, round_trip)

    @staticmethod
    def _timed(step: PlannedStep, call: AgentCall | None) -> None:
        """The call on the timelines of the sequences it decoded and of those whose prompt chunks
        it computed (tracing)."""
        if call is None:
            return
        for seq in step.decodes:
            if seq.timeline is not None:
                seq.timeline.called(call)
        for chunk in step.chunks:
            if chunk.seq.timeline is not None:
                chunk.seq.timeline.called(replace(call, chunk=(chunk.start, chunk.end)))

    def _decoded(self, step: PlannedStep, reply: StepReply) -> list[Sequence]:
        """Each decoding sequence's tokens: one, or with proposals the ones its agent kept and one
        more. The KV of its pending token and of the proposals kept is written; the blocks taken
        for the proposals not kept go back."""
        blocks = self.blocks[step.group]
        touched = []
        for seq, sampled in zip(step.decodes, reply.decoded):
            # aborted while its step was in flight; preempted by a failed tier restore
            if seq.finished or seq.request_id not in blocks:
                continue
            touched.append(seq)
            proposed = proposal_size(step.drafts.get(seq.request_id, []))
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
        return touched

    def _prefilled(self, step: PlannedStep, reply: StepReply) -> list[Sequence]:
        """The chunks ran: their positions hold KV (full blocks join the prefix cache), their
        prompt scores are kept; a prompt's last chunk brings its first token."""
        touched = []
        scored = reply.prompts or [None] * len(step.chunks)
        pooled = reply.pooled or [None] * len(step.chunks)
        for chunk, token, prompt_scores, vector in zip(step.chunks, reply.firsts, scored, pooled):
            seq = chunk.seq
            # aborted while its prefill was in flight; preempted by a failed tier restore (this
            # chunk read blocks never written)
            if seq.finished or seq.request_id not in self.blocks[seq.placement[0]]:
                continue
            if prompt_scores is not None:  # positions start + 1.. (StepChunk.prompt_logprobs)
                seq.prompt_logprobs[chunk.start :] = prompt_scores
            seq.computed = chunk.end
            blocks = self.blocks[seq.placement[0]]
            blocks.computed(seq.request_id, seq.tokens(chunk.end), chunk.end)
            self._states_moved(chunk, blocks)
            if chunk.sample:
                assert token is not None, "a prompt's last chunk samples a token"
                seq.pooled = vector
                self._append(seq, token)
                touched.append(seq)
        return touched

    def _states_moved(self, chunk: Chunk, blocks: BlockManager) -> None:
        """A hybrid model's chunk ran: the snapshot it restored is no longer needed, and the one it
        saved is found by the prefix it ends (scheduler/state_snapshots.py)."""
        seq, snapshots = chunk.seq, self.placement.snapshots[chunk.seq.placement[0]]
        if snapshots is None:
            return
        if chunk.restore is not None:
            self.placement.restored(seq)
        seq.state_saves = [p for p in seq.state_saves if p > chunk.end]
        if chunk.save is not None:
            serial = blocks.serial_of(seq.request_id, chunk.end // blocks.block_size - 1)
            if serial is None:  # its block is not registered (no prefix caching): nothing to find
                snapshots.release(chunk.save)
            else:
                snapshots.saved(chunk.save, serial)

    def _transferred(self, chunk: Chunk, reply: StepReply) -> list[Sequence]:
        """Its prefill group sent the KV and the decode group took it: it decodes from now on."""
        seq, token = chunk.seq, reply.firsts[0]
        assert token is not None  # StepReply.from_wire: the whole prompt samples
        self.placement.free_prefill_slot(seq, computed=True)
        seq.transferring = False
        if seq.finished:  # aborted meanwhile: its decode slot is already being released
            return []
        if reply.prompts and reply.prompts[0] is not None:
            seq.prompt_logprobs[chunk.start :] = reply.prompts[0]
        if reply.pooled:
            seq.pooled = reply.pooled[0]
        seq.computed = len(seq.prompt)
        self._append(seq, token)
        return [seq]

    def _transfer_failed(self, seq: Sequence, error: str) -> list[Sequence]:
        self.placement.free_prefill_slot(seq, computed=False)
        if seq.finished:
            return []
        seq.error = error
        self._finish(seq, FinishReason.ERROR)
        return [seq]

    def _drop_drafts(self, seqs: list[Sequence], drafts: Mapping[str, Proposal]) -> None:
        """The sequences decode without their proposals: the blocks taken for them go back."""
        for seq in seqs:
            if seq.request_id in drafts and not seq.finished:
                self.blocks[seq.placement[0]].truncate(seq.request_id, seq.computed + 1)

    def _fail(self, seqs: list[Sequence], error: str) -> list[Sequence]:
        """End these sequences with an error (theirs, not their group's)."""
        failed = [seq for seq in seqs if not seq.finished]
        for seq in failed:
            seq.error = error
            self._finish(seq, FinishReason.ERROR)
        return failed

    def _group_failed(self, group: int, error: str) -> list[Sequence]:
        """The group is unusable: fail its sequences (and the waiting ones, where no group is left
        to run them); its slots and blocks are forgotten until it returns."""
        if not self.healthy[group]:  # already lost (another call of the same plan said so)
            return []
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
        if not self.can_serve:  # nothing is left to run the waiting ones
            waiting = list(self.waiting)
            self.waiting.clear()
            for seq in waiting:
                seq.error = f"no agent is available: {error}"
                self._finish(seq, FinishReason.ERROR, release=False)
            failed += waiting
        return failed

    def abort_all(self, error: str) -> list[EngineOutput]:
        """Abort every waiting and running sequence, saying why (the engine stops): their final
        outputs."""
        aborted = [*self.waiting, *self.running.values()]
        self.waiting.clear()
        for seq in aborted:
            seq.error = error
            self._finish(seq, FinishReason.ABORT)
        return self._reports(aborted)

    def group_recovered(self, group: int, capacity: GroupCapacity) -> None:
        self.placement.recovered(group, capacity)

    @staticmethod
    def _reports(seqs: Iterable[Sequence]) -> list[EngineOutput]:
        """What the front end has not seen of these sequences (Sequence.report), their timelines
        stamped with a first token and an end."""
        now, outputs = time.monotonic(), []
        for seq in seqs:
            if seq.timeline is not None:
                if seq.timeline.first_token is None and seq.output:
                    seq.timeline.first_token = now
                if seq.finished and seq.timeline.finished is None:
                    seq.timeline.finished = now
            output = seq.report()
            if output is not None:
                outputs.append(output)
        return outputs

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
        self.placement.drop_states(seq)
        if self.running.pop(seq.request_id, None) is not None and release:
            group, slot = seq.placement  # it ran, so it was placed
            self.blocks[group].free(seq.request_id)
            self.pending_releases.append(Release(group, slot, seq.ticket if seq.transferring else None))
