"""Engine: the loop that drives the agent groups (a background asyncio task), as vLLM's EngineCore.

    engine = Engine(config, vocab_size, eos_ids, process_outputs)
    await engine.start()                        # connects to every group and checks `info`
    engine.add_request(EngineRequest(request_id=rid, prompt=ids, sampling=s, max_new_tokens=64))
                                                # or AdmissionError
    ... process_outputs([EngineOutput, ...]) after each step: every touched request's new tokens
        and ends; it returns the ids whose text ended (a stop string), which the engine finishes ...
    engine.stats()                              # EngineStats: running, waiting, each group's slots and blocks
    engine.refuse_new_requests(); await engine.stop()

The step loop is schedule, execute, update (_run and _step below): the BatchScheduler makes a plan
over the groups with no step in flight, final to the last agent call; each group's part runs as a
task of its own (scheduler/step_executor.py), so a slow or stuck group holds only its own
requests, and a prefill on a prefill group (PD disaggregation) too, so decode steps never wait for
it; what the calls came to goes back through the scheduler's update, the one way results enter it,
and what that changed of each request goes to the front end. The loop never blocks the event loop:
agent calls are awaited ZeroMQ round trips. The engine knows token ids only: text, stop strings
and the answer streams are the server's (server/output.py).

With tracing on (server.otlp_endpoint) each sequence gets a Timeline (scheduler/timeline.py): its
admission, the agent calls it took part in, its first token and its end; the server turns it into
spans. Off, nothing is measured.

Should the loop die anyway (a bug), `engine.failure` says why and `engine.dead` is set: every open
request ends with an error, new ones are refused, readiness() reports it. A group whose agent
refuses this server's session (another server opened its own: the newer server wins) is left to
that server: its requests end with an error and it is never reclaimed.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Coroutine, Iterable
from functools import partial

from config.schema import ServingConfig
from scheduler.agent_client import AgentTakenOver
from scheduler.batch_scheduler import BatchScheduler
from scheduler.client_share import ClientShares
from scheduler.engine_io import AdmissionError, EngineOutput, EngineRequest, FinishReason, Refusal
from scheduler.engine_stats import EngineCounts, EngineStats, GroupStats
from scheduler.group_links import GroupLinks
from scheduler.metrics import EngineMetrics
from scheduler.plan import GroupCapacity, PlannedStep, PlanPart, StepOutcome
from scheduler.sequence import Sequence
from scheduler.speculation.speculator import Speculator
from scheduler.step_executor import StepExecutor
from scheduler.timeline import Timeline

log = logging.getLogger(__name__)


class Engine:
    def __init__(
        self,
        config: ServingConfig,
        vocab_size: int,
        eos_ids: Iterable[int],
        process_outputs: Callable[[list[EngineOutput]], Iterable[str]],
        metrics: EngineMetrics | None = None,
    ):
        self.config = config
        # called with what each step changed of each request (its new tokens, once its end); it
        # returns the ids of those whose text ended (a stop string): the engine finishes them
        self.process_outputs = process_outputs
        self.metrics = metrics or EngineMetrics()
        self.links = GroupLinks(config, vocab_size)
        self.clients = self.links.clients
        self.scheduler: BatchScheduler  # built by start(), over the capacities the groups report
        self.executor = StepExecutor(self.clients, self.metrics)  # runs a plan's calls, decides nothing
        self.stop_ids: frozenset[int] = frozenset(eos_ids)  # the groups' EOS ids join at connection
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._recoveries: dict[int, asyncio.Task] = {}
        self._steps: dict[int, asyncio.Task] = {}  # group -> its step in flight (one at a time)
        self._held: set[int] = set()  # groups planned no step for now (a prefix-cache drop)
        self.failure: str | None = None  # why the loop died, if it did
        self.dead = asyncio.Event()  # set when it did: the server process should exit
        self._transfers: set[asyncio.Task] = set()  # prefills that send their KV to a decode group
        self._draining = False
        self._ending = "the server is shutting down"  # what refused and ended requests are told
        self._stopping = False
        self._capacities: list[GroupCapacity] = []
        self._counted: dict = {}  # counter -> the scheduler's total it last reached
        self.timed = config.server.otlp_endpoint is not None  # sequences keep a Timeline
        self._bind_gauges()

    def _bind_gauges(self) -> None:
        m = self.metrics
        m.running.set_function(lambda: self.stats().running)
        m.waiting.set_function(lambda: self.stats().waiting)
        m.slots_used.set_function(lambda: self.stats().running)
        m.tokens_in_flight.set_function(lambda: self.stats().tokens_in_flight)
        m.slots_total.set_function(lambda: self.stats().slots)
        for group in range(len(self.clients)):
            m.group_running.labels(str(group)).set_function(partial(self._group_stat, group, "running"))
            m.group_slots.labels(str(group)).set_function(partial(self._group_stat, group, "slots"))
        for state in ("used", "free", "cached"):
            m.kv_blocks.labels(state).set_function(partial(lambda s: self.stats().kv_blocks(s), state))
        for state in ("held", "free"):
            m.state_snapshots.labels(state).set_function(
                partial(lambda s: self.stats().state_snapshots(s == "held"), state)
            )

    def _group_stat(self, group: int, name: str) -> int:
        return getattr(self.stats().groups[group], name)

    def stats(self) -> EngineStats:
        """What the engine is doing now (scheduler/engine_stats.py): every observer's one source."""
        agents = [tuple(client.address.split(",")) for client in self.clients]
        if not self.started:
            roles = [group.role for group in self.config.agents.groups]
            return EngineStats(
                started=False,
                groups=tuple(
                    GroupStats(group=g, agents=a, role=r) for g, (a, r) in enumerate(zip(agents, roles))
                ),
            )
        return self.scheduler.stats(agents, self.executor.releasing)

    @property
    def started(self) -> bool:
        """Connected to every group, the loop running."""
        return self._task is not None

    @property
    def max_prompt_len(self) -> int | None:
        """The longest prompt some group takes (None before they connect)."""
        return max((c.max_prompt_len for c in self._capacities), default=None)

    @property
    def max_seq_len(self) -> int:
        """The longest sequence any group holds (their runtime may have planned it)."""
        return max(c.max_seq_len for c in self._capacities)

    # ------------------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        self._capacities = await self.links.connect_all()
        self.stop_ids |= frozenset(self.links.eos_ids)
        for client in self.clients:
            self.metrics.agent_up.labels(client.address).set(1)
        s = self.config.scheduler
        self.scheduler = BatchScheduler(
            self._capacities,
            s.max_waiting_requests,
            s.max_prefills_per_step,
            s.max_tokens_in_flight,
            s.max_num_batched_tokens,
            s.enable_prefix_caching,
            s.decode_stall_ratio,
            s.pooling_stall_ratio,
            ClientShares(s.client_share, s.max_running_per_client, s.scheduling_policy == "priority"),
            Speculator(self.config.runtime.speculation),
        )
        self._task = asyncio.create_task(self._run(), name="scheduler-loop")
        self._task.add_done_callback(self._loop_ended)

    def refuse_new_requests(self, reason: str | None = None) -> None:
        """The start of a drain: new requests are refused (503) while the admitted ones finish.
        reason: what they are told (default: the server is shutting down; an unload names the model)."""
        self._draining = True
        self._ending = reason or self._ending

    async def stop(self, reason: str | None = None) -> None:
        """Idempotent: a SIGTERM drain stops the engine, then uvicorn's lifespan exit calls it again.
        Sequences still open end with an output saying why (the server is shutting down)."""
        if self._stopping:
            return
        self._stopping = True
        self._ending = reason or self._ending
        self._wake.set()
        for task in [*self._recoveries.values(), *self._transfers]:
            task.cancel()
        if self._task is not None:
            await asyncio.gather(self._task, return_exceptions=True)
        await asyncio.gather(*self._transfers, return_exceptions=True)
        self.links.close()

    async def readiness(self, ping_timeout_s: float = 2.0) -> str | None:
        """Why the engine cannot take requests now (every group is pinged); None when it can."""
        if not self.started:
            return "not started: waiting for the agents"
        if self.failure is not None:
            return self.failure
        if self._draining or self._stopping:
            return "shutting down"
        healthy = [group.healthy for group in self.stats().groups]
        answering = await self.links.answering(healthy, ping_timeout_s)
        down = []
        for group, (client, up) in enumerate(zip(self.clients, answering)):
            self.metrics.agent_up.labels(client.address).set(int(up))
            if not up and group not in self.links.taken_over:
                down.append(client.address)
        reasons = [self.links.taken_over_reason()] if self.links.taken_over else []
        reasons += [f"agents not answering: {', '.join(down)}"] if down else []
        return "; ".join(reasons) or None

    async def drop_prefix_cache(self) -> dict:
        """Forget every cached prefix, the pool's and the KV tier's, on each healthy group (an
        operator's reset): {"pool_blocks", "tier_blocks" (how many held one), "skipped_groups"
        (unhealthy: nothing of theirs was dropped)}. Raises what the agents' clients raise."""
        pool = tier = 0
        skipped = []
        for group, client in enumerate(self.clients):
            if not self.stats().groups[group].healthy:
                skipped.append(group)
                continue
            # no step is planned for the group meanwhile, and the one in flight ends first: the
            # spills it took reach the tier before the agent empties it, never after
            self._held.add(group)
            try:
                step = self._steps.get(group)
                if step is not None:
                    await asyncio.wait([step])
                dropped, tiered = self.scheduler.drop_cache(group)
                pool += dropped
                if tiered:
                    dropped, report = await client.drop_cache()
                    tier += dropped
                    if report is not None:
                        self.metrics.count_tier(group, report)
            finally:
                self._held.discard(group)
                self._wake.set()
        log.info("prefix cache dropped: %d pool blocks, %d tier blocks", pool, tier)
        return {"pool_blocks": pool, "tier_blocks": tier, "skipped_groups": skipped}

    # -------------------------------------------------------------------------------- requests

    def add_request(self, request: EngineRequest) -> None:
        """Queues the request's sequence at once, or raises AdmissionError if it is refused. Its
        outputs come through process_outputs (scheduler/engine_io.py)."""
        if not self.started:
            raise AdmissionError("the server is not ready", Refusal.NOT_READY)
        if self.failure is not None:
            raise AdmissionError(f"the server cannot serve: {self.failure}", Refusal.NOT_READY)
        if self._draining or self._stopping:
            raise AdmissionError(self._ending, Refusal.SHUTTING_DOWN)
        if self.links.taken_over and not self.scheduler.can_serve:
            raise AdmissionError(self.links.taken_over_reason(), Refusal.NO_GROUP)
        timeline = Timeline(time.monotonic(), context=request.trace) if self.timed else None
        seq = Sequence.from_request(request, request.stop_ids(self.stop_ids), timeline)
        self.scheduler.add(seq)
        self.metrics.prompt_tokens.inc(len(seq.prompt))
        self._wake.set()

    def abort(self, request_id: str) -> None:
        """The client is gone: the request ends at once (its final output processed), its slot is
        released by the next plan."""
        self._finish([request_id], FinishReason.ABORT)
        self._wake.set()

    # ---------------------------------------------------------------------------- the loop

    async def _run(self) -> None:
        """The step loop: a plan over the groups with no step in flight, each group's part of it
        (and each transfer) a task of its own that executes it and updates the scheduler."""
        while not self._stopping and self.failure is None:
            plan = self.scheduler.schedule(busy=self._steps.keys() | self._held)
            self._count(self.scheduler.counts())  # each loop: the counters, not the whole stats
            for group, part in plan.parts.items():
                self.executor.planned(part)
                ended = partial(self._step_ended, group)
                self._steps[group] = self._start(self._step(part), f"step-group-{group}", ended)
            for step in plan.transfers:
                name = f"prefill-group-{step.group}"
                self._transfers.add(self._start(self._transfer(step), name, self._transfer_ended))
            self._wake.clear()  # set again by a new request, an abort, a finished step or transfer
            await self._wake.wait()
        for task in self._steps.values():  # stop(): the drain is over; a step in flight is moot
            task.cancel()
        await asyncio.gather(*self._steps.values(), return_exceptions=True)
        self._end_all(self._ending)

    async def _step(self, part: PlanPart) -> None:
        """One group's step: execute its part of the plan, then update."""
        self._update(await self.executor.execute(part))

    async def _transfer(self, step: PlannedStep) -> None:
        """A prompt computed on its prefill group and its KV sent to its decode group, then update."""
        self._update([await self.executor.transfer(step)])

    def _update(self, outcomes: list[StepOutcome]) -> None:
        """What the calls came to into the scheduler, what that changed of each request to the
        front end; a lost group is probed until it answers again."""
        for outcome in outcomes:
            if outcome.group_failure is not None:
                self._group_lost(outcome.group, outcome.group_failure)
        outputs = self.scheduler.update(outcomes)
        self._process(outputs)

    def _process(self, outputs: list[EngineOutput]) -> None:
        """The outputs to the front end; the requests whose text it found ended (a stop string)
        end here too, and their ends go out."""
        stopped = list(self.process_outputs(outputs)) if outputs else []
        if stopped:
            self.process_outputs(self.scheduler.finish_requests(stopped, FinishReason.STOP))

    def _finish(self, request_ids: list[str], reason: FinishReason) -> None:
        self._process(self.scheduler.finish_requests(request_ids, reason))

    def _start(self, work: Coroutine, name: str, ended: Callable[[asyncio.Task], None]) -> asyncio.Task:
        task = asyncio.create_task(work, name=name)
        task.add_done_callback(ended)
        return task

    def _count(self, counts: EngineCounts) -> None:
        """The scheduler's totals into the metrics' counters."""
        m = self.metrics
        for counter, total in (
            (m.prefix_cache_queries, counts.prefix_query_tokens),
            (m.prefix_cache_hits, counts.prefix_hit_tokens),
            (m.prefix_cache_tier_hits, counts.prefix_tier_hit_tokens),
            (m.state_restores, counts.state_restores),
            (m.preemptions, counts.preemptions),
            (m.proposed_tokens, counts.proposed_tokens),
            (m.accepted_tokens, counts.accepted_tokens),
            (m.speculative_steps, counts.speculative_steps),
        ):
            counter.inc(total - self._counted.get(counter, 0))
            self._counted[counter] = total

    def _loop_ended(self, task: asyncio.Task) -> None:
        """The loop's task is over: after stop() that is the plan; anything else kills the engine."""
        if task.cancelled():
            self._die("the scheduler loop was cancelled")
        elif task.exception() is not None:
            exc = task.exception()
            log.error("scheduler loop failed", exc_info=exc)
            self._die(f"the scheduler loop failed: {type(exc).__name__}: {exc}")
        elif not self._stopping:
            self._die("the scheduler loop ended")

    def _step_ended(self, group: int, task: asyncio.Task) -> None:
        self._steps.pop(group, None)
        self._ended(task, f"step of group {group}")

    def _transfer_ended(self, task: asyncio.Task) -> None:
        self._transfers.discard(task)
        self._ended(task, "a KV transfer")

    def _ended(self, task: asyncio.Task, what: str) -> None:
        """A step or transfer task is over; its outcomes are in. One that failed here is a bug:
        the engine cannot go on."""
        self._wake.set()
        if not task.cancelled() and task.exception() is not None:
            exc = task.exception()
            log.error("%s failed", what, exc_info=exc)
            self._die(f"{what} failed: {type(exc).__name__}: {exc}")

    def _die(self, reason: str) -> None:
        """The engine cannot go on: say why, end every open request with an error, refuse the rest."""
        if self.failure is not None:
            return
        self.failure = f"internal error, the server must restart: {reason}"
        log.critical("%s", self.failure)
        for task in [*self._steps.values(), *self._recoveries.values(), *self._transfers]:
            task.cancel()
        self._end_all(self.failure)
        self.dead.set()
        self._wake.set()  # the loop, if it still runs, ends

    def _end_all(self, error: str) -> None:
        """End every open request, each end processed on its own (one failing ends no other)."""
        try:
            ended = self.scheduler.abort_all(error)
        except Exception:
            log.exception("ending the open requests failed")
            return
        for output in ended:
            try:
                self.process_outputs([output])
            except Exception:
                log.exception("processing the end of request %s failed", output.request_id)

    def _group_lost(self, group: int, exc: BaseException) -> None:
        """The group's agent failed (the scheduler fails its requests): say so, and probe it
        until it answers again, unless another server took it over."""
        if group in self._recoveries or not self.stats().groups[group].healthy:
            return  # lost already (another call of the same plan said so)
        address = self.clients[group].address
        if isinstance(exc, AgentTakenOver):
            self.links.taken_over.add(group)
            log.error("agent %s: another server took it over; this server no longer uses it", address)
        else:
            log.error("agent %s failed: %s", address, exc)
        self.metrics.agent_up.labels(address).set(0)
        if not self._stopping and group not in self.links.taken_over:  # the newer server keeps it
            self._recoveries[group] = asyncio.create_task(self._recover(group), name=f"recover-group-{group}")

    async def _recover(self, group: int) -> None:
        """Give a failed group's slots back to the scheduler once it answers again."""
        capacity = await self.links.recover(group, lambda: self._stopping)
        self._recoveries.pop(group, None)
        if capacity is None:  # a newer server holds it, or this engine stops
            return
        self._capacities[group] = capacity
        self.scheduler.group_recovered(group, capacity)
        self.metrics.agent_up.labels(self.clients[group].address).set(1)
        log.info("agent %s is back: serving on it again", self.clients[group].address)
        self._wake.set()
