"""StepExecutor: runs one group's part of a step plan on its agents (the engine's loop,
scheduler/engine.py, starts one such task per group it plans for, at most one per group at a time).

A group's part runs in this order: its slot releases, one decode (a stream never waits for a
prompt), then its prompt chunks; the decode and the group's own chunks as one mixed agent step
where they fit, each part alone where the agent refuses the whole as a bad request. A prompt
whose sequence decodes on a decode group (PD disaggregation) is computed on its prefill group by
a task of its own, which sends the KV to the decode group's slot; decode steps never wait for it.

Every model call is one agent step (StepRequest / StepReply, agent/contract/step.py), timed into
the metrics and the group's step costs. Outcomes go back through the scheduler (its token rules)
and the engine's hooks: each touched sequence is reported; an agent's failure fails its group.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import numpy as np

from agent.contract.step import KVTransfer, Proposal, StepChunk, StepRequest, proposal_size
from agent.contract.step_reply import StepReply
from scheduler.agent_client import AgentClient, AgentError, AgentRequestError, ModelClient
from scheduler.batch_scheduler import BatchScheduler
from scheduler.engine_io import FinishReason
from scheduler.metrics import ServingMetrics
from scheduler.plan import Chunk, StepPlan, attended
from scheduler.sequence import Sequence
from scheduler.timeline import AgentCall

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StepHooks:
    """What the engine does with a step's outcomes."""

    report: Callable[[Sequence], None]  # a sequence's new tokens or its end, to the front end
    group_failed: Callable[[int, BaseException], None]  # its requests end; the group is probed
    die: Callable[[str], None]  # a failure handler failed (a bug): the engine cannot go on
    wake: Callable[[], None]  # the loop plans again (a KV transfer ended)


class StepExecutor:
    def __init__(
        self,
        scheduler: BatchScheduler,
        clients: list[ModelClient],
        metrics: ServingMetrics,
        hooks: StepHooks,
        transfers: set[asyncio.Task],
        timed: bool = False,
    ):
        self.scheduler = scheduler
        self.clients = clients  # the engine's list, by group
        self.metrics = metrics
        self.hooks = hooks
        self._transfers = transfers  # prefills that send their KV to a decode group: the engine's
        self.timed = timed  # sequences keep a Timeline (tracing)
        # group -> its slot releases planned and not yet answered by its agent
        self.releasing: Counter[int] = Counter()

    def start(self, group: int, plan: StepPlan) -> asyncio.Task:
        """The group's part of the plan, as a task of its own."""
        self.releasing[group] = len(plan.releases)  # at once: the plan took them from the scheduler
        return asyncio.create_task(self._run(group, plan), name=f"step-group-{group}")

    async def _run(self, group: int, plan: StepPlan) -> None:
        try:
            await self._step(group, plan)
        except Exception as exc:  # a bug must not leave the step's requests hanging
            log.exception("scheduler step of group %d failed", group)
            self.fail(
                [c.seq for c in plan.prefills] + [s for seqs in plan.decodes.values() for s in seqs],
                f"internal error: {type(exc).__name__}: {exc}",
            )
        finally:
            self.releasing.pop(group, None)

    async def _step(self, group: int, plan: StepPlan) -> None:
        """Run one group's plan: releases, one decode (a stream never waits for a prompt), then
        the prompt chunks; the decode and the group's own chunks as one mixed call where it fits."""
        for release_group, slot, ticket in plan.releases:
            try:
                await self.clients[release_group].release(slot, ticket)
            except AgentError as exc:
                self.hooks.group_failed(release_group, exc)
            self.releasing[release_group] -= 1
        # aborted since the plan was made: their blocks are already free
        seqs = [s for s in plan.decodes.get(group, []) if not s.finished]
        local: list[Chunk] = []
        rest: list[Chunk] = []  # PD transfers, aborted sequences
        for chunk in plan.prefills:
            # a chunk that scores its prompt positions runs in a prefill step of its own
            mixes = chunk.seq.prefill_group is None and not chunk.seq.finished and not _scores(chunk)
            (local if mixes else rest).append(chunk)
        healthy, capacity = self.scheduler.healthy[group], self.scheduler.groups[group]
        proposed = plan.proposed(seqs)
        # the prompts that do not fit beside the proposals run after the decode and its proposals
        together = local if capacity.mixes(len(seqs), local, proposed) else []
        if healthy and capacity.mixes(len(seqs), together, proposed):
            if await self._mixed(group, seqs, together, plan.drafts):
                for chunk in rest if together else plan.prefills:
                    await self._prefill_chunk(chunk)
                return
            # the agent refused the step (a bad request in it): each part alone, so only that one fails
        if seqs and self.scheduler.healthy[group]:
            self.scheduler.drop_drafts(seqs, plan.drafts)  # decoded alone: the proposals go unverified
            try:
                reply = await self._agent_step(group, seqs, [])
            except Exception as exc:
                self.hooks.group_failed(group, exc)
                return
            self._apply(seqs, [], reply)
        for chunk in plan.prefills:
            await self._prefill_chunk(chunk)

    async def _prefill_chunk(self, chunk: Chunk) -> None:
        seq = chunk.seq
        if seq.prefill_group is not None and seq.finished:  # aborted before its prefill ran
            self.scheduler.transfer_failed(seq, "aborted")
        elif seq.prefill_group is not None and seq.transferring:
            task = asyncio.create_task(self._prefill_elsewhere(chunk), name=f"prefill-{seq.request_id}")
            self._transfers.add(task)
            task.add_done_callback(self._transfer_ended)
        elif not seq.finished:  # else aborted, or its group failed earlier in this plan
            await self._prefill(chunk)

    async def _mixed(
        self, group: int, seqs: list[Sequence], chunks: list[Chunk], drafts: dict[str, Proposal]
    ) -> bool:
        """The group's decode (with the tokens proposed after its sequences' pending tokens:
        `drafts`) and its prompt chunks in one agent call; False when the agent refused it as a bad
        request (nothing ran: the caller runs the parts one by one)."""
        try:
            reply = await self._agent_step(group, seqs, chunks, drafts)
        except AgentRequestError as exc:
            address = self.clients[group].address
            log.warning("agent %s refused a mixed step (%s): its parts run one by one", address, exc)
            return False
        except AgentError as exc:
            self.hooks.group_failed(group, exc)
            return True
        self._apply(seqs, chunks, reply, drafts)
        return True

    async def _agent_step(
        self, group: int, seqs: list[Sequence], chunks: list[Chunk], drafts: dict[str, Proposal] | None = None
    ) -> StepReply:
        """The group's step of these decoding sequences (with the tokens proposed after their
        pending tokens: `drafts`) and these prompt chunks, as one agent step."""
        blocks, drafts = self.scheduler.blocks[group], drafts or {}
        # the KV tier's moves queued since the group's last step: before this step writes or reads
        spill, restore = blocks.take_spills(), blocks.take_restores()
        request = StepRequest(
            [s.placement[1] for s in seqs],
            [blocks.table(s.request_id) for s in seqs],
            [self._step_chunk(c) for c in chunks],
            _masks([*seqs, *(c.seq for c in chunks if c.sample)]),
            {s.placement[1]: drafts[s.request_id] for s in seqs if s.request_id in drafts},
            spill=spill,
            restore=restore,
        )
        try:
            reply = await self._timed_step(group, request, seqs, chunks)
        except AgentRequestError:  # refused (the parts then run alone): the next step carries them
            blocks.spills[:0], blocks.restores[:0] = spill, restore
            raise
        if reply.tier is not None:
            self.metrics.count_tier(group, reply.tier)
            blocks.tier_evicted(reply.tier.evicted_keys)  # the index holds only what the tier does
        if reply.restore_failed:
            log.warning(
                "agent %s: %d of %d blocks not in its KV tier: their sequences are recomputed",
                self.clients[group].address,
                len(reply.restore_failed),
                len(restore),
            )
            preempted = self.scheduler.tier_restore_failed(group, list(reply.restore_failed), restore)
            for seq in preempted:  # its slot may have sampled from the garbage: seated afresh
                await self.clients[group].release(seq.placement[1])
        return reply

    async def _timed_step(
        self, group: int, request: StepRequest, seqs: list[Sequence], chunks: list[Chunk]
    ) -> StepReply:
        """The engine's one call that runs the model: an agent step, timed (agent_step by its
        kind, the timelines of its sequences) and, where it decodes, measured for the group's step
        costs. Raises what the client raises."""
        client = self.clients[group]
        op, attending, start = request.kind, attended(seqs), time.monotonic()
        with self.metrics.agent_step.labels(client.address, op).time():
            reply = await client.step(request)
        round_trip = time.monotonic() - start
        if self.timed:
            self._timed("prefill_and_send" if request.transfer else op, client.address, start, seqs, chunks)
        if seqs:
            seconds, costs = client.decode_compute_s, self.scheduler.step_costs[group]
            self.metrics.agent_compute.labels(client.address, op).observe(seconds)
            if op == "step":
                costs.mixed(len(seqs), attending, [(c.start, c.end) for c in chunks], seconds)
            else:
                costs.decoded(len(seqs), attending, seconds)
            if not chunks:  # a decode, alone or verifying proposals: what proposals cost
                # Timed as the scheduler waits for it: a step's tokens cost the whole round trip
                # (ZeroMQ, (de)serialising: ~0.7 ms of the default model's 7.3 ms step), and with the
                # agent's compute alone the proposal lengths undervalued each step's extra tokens
                # (copy-heavy work at 1 stream, 1.35x against 1.49x for 4 proposals every step).
                proposed = sum(proposal_size(p) for p in request.drafts.values())
                self.scheduler.verify_costs[group].sampled(len(seqs), proposed, round_trip)
        return reply

    def _apply(
        self,
        seqs: list[Sequence],
        chunks: list[Chunk],
        reply: StepReply,
        drafts: dict[str, Proposal] | None = None,
    ) -> None:
        """A step's tokens to its sequences, each reported: the decode's, then the chunks' first
        tokens (where they sample)."""
        if seqs:
            self.scheduler.decoded(seqs, reply.decoded, drafts)
        for seq in seqs:
            self.hooks.report(seq)
        for chunk, token, scores in zip(chunks, reply.firsts, reply.prompts or [None] * len(chunks)):
            seq = chunk.seq
            if not seq.finished and seq.request_id not in self.scheduler.blocks[seq.placement[0]]:
                continue  # preempted by a failed tier restore: this chunk read blocks never written
            if scores is not None:  # positions start + 1.. (StepChunk.prompt_logprobs)
                chunk.seq.prompt_logprobs[chunk.start :] = scores
            self.scheduler.prefilled(chunk, token)
            if chunk.sample:
                self.hooks.report(chunk.seq)

    def _transfer_ended(self, task: asyncio.Task) -> None:
        self._transfers.discard(task)
        if not task.cancelled() and task.exception() is not None:  # its own failure handler failed
            exc = task.exception()
            log.error("a KV transfer failed while handling a failure", exc_info=exc)
            self.hooks.die(f"a KV transfer failed: {type(exc).__name__}: {exc}")

    async def _prefill(self, chunk: Chunk) -> None:
        group = chunk.seq.placement[0]
        try:
            reply = await self._agent_step(group, [], [chunk])
        except AgentRequestError as exc:  # this request was bad; the group is fine
            self.fail([chunk.seq], str(exc))
            return
        except AgentError as exc:
            self.hooks.group_failed(group, exc)
            return
        self._apply([], [chunk], reply)

    async def _prefill_elsewhere(self, chunk: Chunk) -> None:
        """PD disaggregation: the prefill group computes the prompt (from its prefix-cache hit)
        and sends its KV straight to the decode group's slot and blocks; the sequence decodes
        there from the next step on."""
        seq = chunk.seq
        (prefill_group, prefill_slot), (group, slot) = seq.prefill_placement, seq.placement
        prefill, decode = self.clients[prefill_group], self.clients[group]
        # A prefill group is one agent: the config makes tensor-parallel groups mixed.
        assert isinstance(prefill, AgentClient), f"prefill group {prefill.address} is not one agent"
        assert seq.ticket is not None  # given when the transfer was planned
        transfer = KVTransfer(
            decode.address,
            slot,
            decode.session,
            seq.ticket,
            tuple(self.scheduler.blocks[group].table(seq.request_id)),
        )
        table = self.scheduler.blocks[prefill_group].table(seq.request_id)
        whole = StepChunk(
            prefill_slot,
            seq.prompt,
            table,
            chunk.start,
            seq.sampling,
            prompt_logprobs=seq.sampling.prompt_logprobs if _scores(chunk) else None,
        )
        request = StepRequest(chunks=[whole], masks=_masks([seq], prefill_slot), transfer=transfer)
        try:
            reply = await self._timed_step(prefill_group, request, [], [chunk])
        except AgentRequestError as exc:  # this request failed (its KV did not arrive); the group is fine
            log.warning("request %s failed on %s: %s", seq.request_id, prefill.address, exc)
            self.scheduler.transfer_failed(seq, str(exc))
            self.hooks.report(seq)
        except AgentError as exc:
            self.hooks.group_failed(prefill_group, exc)  # fails seq too
            self.scheduler.transfer_failed(seq, str(exc))
        except Exception as exc:  # a bug must not leave the request hanging
            log.exception("request %s: prefill on %s failed", seq.request_id, prefill.address)
            self.scheduler.transfer_failed(seq, f"internal error: {type(exc).__name__}: {exc}")
            self.hooks.report(seq)
        else:
            token, kv_bytes, transfer_ms = reply.firsts[0], reply.kv_bytes, reply.transfer_ms
            assert token is not None  # StepReply.from_wire: the whole prompt samples
            if reply.prompts and reply.prompts[0] is not None:
                seq.prompt_logprobs[chunk.start :] = reply.prompts[0]
            self.metrics.kv_transfer_bytes.inc(kv_bytes)
            self.metrics.kv_transfer.observe(transfer_ms / 1000)
            log.debug(
                "request %s: KV of %d tokens (%d bytes) moved to %s slot %d in %.1f ms",
                seq.request_id,
                len(seq.prompt),
                kv_bytes,
                decode.address,
                slot,
                transfer_ms,
            )
            self.scheduler.transferred(seq, token)
            self.hooks.report(seq)
        self.hooks.wake()

    def _step_chunk(self, chunk: Chunk) -> StepChunk:
        """The planned chunk as the agents take it: the slot's tokens up to its end, its blocks,
        and its sequence's sampling where it samples."""
        seq = chunk.seq
        group, slot = seq.placement
        table = self.scheduler.blocks[group].table(seq.request_id)
        scores = _scores(chunk)
        return StepChunk(
            slot,
            seq.tokens(chunk.end),
            table,
            chunk.start,
            seq.sampling if chunk.sample else None,
            prompt_logprobs=seq.sampling.prompt_logprobs if scores else None,
            lookahead=seq.prompt[chunk.end] if scores and chunk.end < len(seq.prompt) else None,
        )

    def fail(self, seqs: list[Sequence], error: str) -> None:
        """End these sequences with an error (one request's, not its group's)."""
        for seq in seqs:
            if not seq.finished:
                seq.error = error
                self.scheduler.finish(seq, FinishReason.ERROR)
                self.hooks.report(seq)

    def _timed(
        self, op: str, agent: str, start: float, seqs: Iterable[Sequence], chunks: Iterable[Chunk] = ()
    ) -> None:
        """An agent call that ended now, on the timelines of the sequences it decoded and of those
        whose prompt chunks it computed (tracing)."""
        end = time.monotonic()
        for seq in seqs:
            if seq.timeline is not None:
                seq.timeline.called(AgentCall(op, agent, start, end))
        for chunk in chunks:
            if chunk.seq.timeline is not None:
                chunk.seq.timeline.called(AgentCall(op, agent, start, end, (chunk.start, chunk.end)))


def _scores(chunk: Chunk) -> bool:
    """Whether the chunk scores its prompt positions: its sequence asked for prompt logprobs and
    has them up to the chunk's start (a recompute from position 0 scores them again)."""
    seq = chunk.seq
    return seq.scoring_prompt and chunk.start <= len(seq.prompt_logprobs) and chunk.end <= len(seq.prompt)


def _masks(seqs: Iterable[Sequence], slot: int | None = None) -> dict[int, np.ndarray]:
    """The token masks of the sequences whose next token is constrained, by slot (structured
    output, a spent thinking budget); `slot`: the one sequence's slot on a prefill group."""
    masks = {
        s.placement[1] if slot is None else slot: s.constraint.mask()
        for s in seqs
        if s.constraint is not None
    }
    return {at: mask for at, mask in masks.items() if mask is not None}
