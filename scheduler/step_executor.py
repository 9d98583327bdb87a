"""StepExecutor: runs a plan's agent calls and says what each came to (StepOutcome). It decides
nothing and changes no scheduler state: the plan (scheduler/batch_scheduler.py) is final, and the
outcomes go back to the scheduler's update (scheduler/engine.py's step loop).

    outcomes = await executor.execute(part)       # one group's releases, then its agent steps
    outcome = await executor.transfer(step)       # PD: a prompt computed and its KV sent elsewhere

A group's calls run one after the other, in the plan's order; once its agent fails, the rest of
its calls are not made (the group is lost). Every model call is one agent step (StepRequest /
StepReply, agent/contract/step.py), timed into the metrics.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from dataclasses import replace

from agent.contract.step import KVTransfer, StepRequest
from scheduler.agent_client import AgentError, AgentRequestError, ModelClient
from scheduler.metrics import EngineMetrics
from scheduler.plan import Failure, PlannedStep, PlanPart, Release, StepOutcome
from scheduler.timeline import AgentCall

log = logging.getLogger(__name__)


class StepExecutor:
    def __init__(self, clients: list[ModelClient], metrics: EngineMetrics):
        self.clients = clients  # the engine's list, by group
        self.metrics = metrics
        # group -> its slot releases planned and not yet answered by its agent
        self.releasing: Counter[int] = Counter()

    def planned(self, part: PlanPart) -> None:
        """The part's releases are on their way (the plan took them from the scheduler)."""
        self.releasing[part.group] = len(part.releases)

    async def execute(self, part: PlanPart) -> list[StepOutcome]:
        """The group's releases, then its agent steps; each call's outcome, up to the first that
        loses the group."""
        outcomes = []
        try:
            for release in part.releases:
                outcomes.append(await self._release(release))
                self.releasing[part.group] -= 1
                if outcomes[-1].group_failure is not None:
                    return outcomes
            for step in part.steps:
                outcomes.append(await self._step(step, step.request))
                if outcomes[-1].group_failure is not None:
                    return outcomes
            return outcomes
        finally:
            self.releasing.pop(part.group, None)

    async def transfer(self, step: PlannedStep) -> StepOutcome:
        """PD disaggregation: the prefill group computes the prompt and sends its KV straight to
        the decode group's slot and blocks (step.send_to)."""
        destination = step.send_to
        assert destination is not None, "a transfer says where its KV goes"
        decode = self.clients[destination.group]
        transfer = KVTransfer(
            decode.address, destination.slot, decode.session, destination.ticket, destination.table
        )
        outcome = await self._step(step, replace(step.request, transfer=transfer))
        if outcome.reply is not None:
            self.metrics.kv_transfer_bytes.inc(outcome.reply.kv_bytes)
            self.metrics.kv_transfer.observe(outcome.reply.transfer_ms / 1000)
        return outcome

    async def _release(self, release: Release) -> StepOutcome:
        client = self.clients[release.group]
        try:
            await client.release(release.slot, release.ticket)
        except Exception as exc:
            return self._failed(release.group, release, exc)
        return StepOutcome(group=release.group, agent=client.address, part=release)

    async def _step(self, step: PlannedStep, request: StepRequest) -> StepOutcome:
        """The engine's one call that runs the model: an agent step, timed (agent_step by its kind;
        the agent's compute where it decodes)."""
        client = self.clients[step.group]
        op = "prefill_and_send" if request.transfer else request.kind
        start = time.monotonic()
        try:
            with self.metrics.agent_step.labels(client.address, request.kind).time():
                reply = await client.step(request)
        except Exception as exc:
            return self._failed(step.group, step, exc)
        call = AgentCall(op, client.address, start, time.monotonic())
        compute_s = client.decode_compute_s if step.decodes else 0.0
        if step.decodes:
            self.metrics.agent_compute.labels(client.address, request.kind).observe(compute_s)
        if reply.tier is not None:
            self.metrics.count_tier(step.group, reply.tier)
        if reply.restore_failed:
            log.warning(
                "agent %s: %d of %d blocks not in its KV tier: their sequences are recomputed",
                client.address,
                len(reply.restore_failed),
                len(request.restore),
            )
        return StepOutcome(
            group=step.group, agent=client.address, part=step, reply=reply, call=call, compute_s=compute_s
        )

    def _failed(self, group: int, part: PlannedStep | Release, exc: Exception) -> StepOutcome:
        address = self.clients[group].address
        if isinstance(exc, AgentRequestError):
            failure = Failure.REFUSED
            if isinstance(part, PlannedStep) and part.mixed:
                log.warning("agent %s refused a mixed step (%s): its parts run alone", address, exc)
        elif isinstance(exc, AgentError):
            failure = Failure.AGENT
        else:  # a bug must not leave the step's requests hanging
            log.error("an agent call of group %d failed", group, exc_info=exc)
            failure = Failure.INTERNAL
        return StepOutcome(group=group, agent=address, part=part, error=exc, failure=failure)
