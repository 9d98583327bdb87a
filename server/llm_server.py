"""LLMServer: owns the scheduler loop (a background asyncio task) and one async stream per request.

    server = LLMServer(config, tokenizer)
    await server.start()                       # connects to every agent and checks `info`
    async for out in server.generate_answer(request_id, prompt_ids, sampling, max_new_tokens):
        out.text ...                           # pieces join to the full answer; last one: finished
    server.get_bs_current(), server.get_queue_current()
    await server.drain(timeout_s)              # SIGTERM: refuse new requests, let the rest finish
    await server.stop()

The loop never blocks the event loop: agent calls are awaited ZeroMQ round trips. Each iteration
runs one plan of the BatchScheduler: releases, prefills, then one decode step per agent (agents in
parallel). A prefill on a prefill agent (PD disaggregation) runs as a task of its own beside the
loop, so decode steps never wait for it. Detokenization and stop strings happen here, on the server
side; agents see token ids only.
"""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

from agent.contract.sampling import SamplingParams
from config.schema import ServingConfig
from scheduler.agent_client import (AgentClient, AgentError, AgentIncompatible, AgentRequestError,
                                    AgentUnavailable, GroupClient)
from scheduler.batch_scheduler import AdmissionError, AgentCapacity, BatchScheduler, StepPlan
from scheduler.sequence import FinishReason, Sequence
from agent.model.detokenizer import IncrementalDetokenizer
from server.metrics import ServingMetrics
from agent.model.tokenizer import TextTokenizer

log = logging.getLogger(__name__)

RECOVERY_PROBE_S = 2.0  # a failed agent is asked for `info` with this timeout ...
RECOVERY_INTERVAL_S = 1.0  # ... this long apart, until it answers (the launcher restarted it)


@dataclass
class GenerationOutput:
    text: str  # new text since the previous output (may be empty)
    token_id: int | None
    index: int  # number of tokens generated so far
    finished: bool = False
    finish_reason: str | None = None
    error: str | None = None


@dataclass
class _Stream:
    seq: Sequence
    queue: asyncio.Queue
    detokenizer: IncrementalDetokenizer
    stop: tuple[str, ...]
    hold: int = 0  # characters held back: the longest stop string but one
    consumed: int = 0  # tokens of seq.output already detokenized
    sent: int = 0  # characters of detokenizer.text already handed out
    admitted: float = field(default_factory=time.monotonic)
    last_token: float | None = None  # when the previous token went out
    counted: bool = False  # its outcome is in the metrics


class AnswerStream:
    """One request's outputs, as an async iterator. aclose() aborts an unfinished request and frees
    its slot, also when the stream was never iterated (a client gone before the first byte)."""

    def __init__(self, server: "LLMServer", stream: _Stream):
        self._server, self._stream, self._done = server, stream, False

    def __aiter__(self) -> "AnswerStream":
        return self

    async def __anext__(self) -> GenerationOutput:
        if self._done:
            raise StopAsyncIteration
        output = await self._stream.queue.get()
        if output.finished:
            self._done = True
            self._server._close(self._stream)
        return output

    async def aclose(self) -> None:
        self._done = True
        self._server._close(self._stream)

    def __del__(self) -> None:
        # Safety net: a response dropped before it ever iterated (nor closed) this stream.
        if not self._done:
            self._server._close(self._stream)


class LLMServer:
    def __init__(self, config: ServingConfig, tokenizer: TextTokenizer,
                 metrics: ServingMetrics | None = None):
        self.config = config
        self.tokenizer = tokenizer
        self.metrics = metrics or ServingMetrics()
        self.clients = [self._group_client(group) for group in range(len(config.agents.groups))]
        self.scheduler: BatchScheduler | None = None
        self.streams: dict[str, _Stream] = {}
        self.stop_ids: frozenset[int] = frozenset(tokenizer.eos_ids)
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._recoveries: dict[int, asyncio.Task] = {}
        self._transfers: set[asyncio.Task] = set()  # prefills that send their KV to a decode agent
        self._draining = False
        self._stopping = False
        self.capacities: list[AgentCapacity] = []
        m = self.metrics
        m.running.set_function(self.get_bs_current)
        m.waiting.set_function(self.get_queue_current)
        m.slots_used.set_function(self.get_bs_current)
        m.open_streams.set_function(lambda: len(self.streams))
        m.tokens_in_flight.set_function(lambda: self.scheduler.tokens_in_flight if self.scheduler else 0)
        m.slots_total.set_function(lambda: sum(
            c.num_slots for c, ok in zip(self.capacities, self.scheduler.healthy)
            if ok and c.decodes) if self.scheduler else 0)
        for group in range(len(self.clients)):
            m.group_running.labels(str(group)).set_function(lambda g=group: self.get_bs_current(g))
            m.group_slots.labels(str(group)).set_function(lambda g=group: self.group_slots(g))

    def _group_client(self, group: int) -> AgentClient | GroupClient:
        agents = self.config.agents
        clients = [AgentClient(agents.address(rank), self.config.server.agent_timeout_s, agents.curve)
                   for rank, g in enumerate(agents.group_of_rank) if g == group]
        return clients[0] if len(clients) == 1 else GroupClient(clients)

    @property
    def max_seq_len(self) -> int:
        """The longest sequence any agent holds (their runtime may have planned it)."""
        return max(c.max_seq_len for c in self.capacities)

    # ------------------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        self.capacities = [await self._wait_for_agent(i, c) for i, c in enumerate(self.clients)]
        for client in self.clients:
            self.metrics.agent_up.labels(client.address).set(1)
        s = self.config.server
        self.scheduler = BatchScheduler(self.capacities, s.max_waiting_requests,
                                        s.max_prefills_per_step, s.max_tokens_in_flight)
        self._task = asyncio.create_task(self._run(), name="scheduler-loop")

    async def _wait_for_agent(self, index: int, client: AgentClient) -> AgentCapacity:
        deadline = time.monotonic() + self.config.server.agent_wait_s
        while True:
            try:
                return await self._connect(index, client)
            except AgentUnavailable as exc:
                if time.monotonic() > deadline:
                    raise AgentError(f"agent {client.address} not answering after "
                                     f"{self.config.server.agent_wait_s:g}s: {exc}") from exc
                log.info("waiting for agent %s (%s)", client.address, exc)
                if client.lost:
                    client.reconnect()

    async def _connect(self, index: int, client: AgentClient,
                       timeout_s: float | None = None) -> AgentCapacity:
        """Check the agent serves our model, then open this server's session on it (every slot
        released: this server owns them all)."""
        info = await client.info(timeout_s)
        if info["vocab_size"] < self.tokenizer.vocab_size:
            raise AgentIncompatible(f"agent {client.address} serves a vocabulary of {info['vocab_size']} "
                                    f"tokens; the tokenizer has {self.tokenizer.vocab_size}")
        role = self.config.agents.groups[index].role
        if info.get("role") != role:
            raise AgentIncompatible(f"agent {client.address} runs as a {info.get('role')} agent; this "
                                    f"server's config makes it {role} (start both from one config)")
        await client.reset(timeout_s)
        self.stop_ids |= frozenset(info["eos_ids"])
        log.info("agent %d at %s: %s, model %s, %d slots, max length %d", index, client.address,
                 role, info["model"], info["num_slots"], info["max_seq_len"])
        return AgentCapacity(info["num_slots"], info["max_seq_len"], info["max_prompt_len"], role)

    async def drain(self, timeout_s: float) -> None:
        """Refuse new requests (503) and wait up to `timeout_s` for the admitted ones to finish;
        stop() then ends whatever is left with a final output saying so."""
        self._draining = True
        deadline = time.monotonic() + timeout_s
        if self.streams:
            log.info("draining %d request(s), up to %gs", len(self.streams), timeout_s)
        while self.streams and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self.streams:
            log.warning("drain timeout: ending %d unfinished request(s)", len(self.streams))
        await self.stop()

    async def stop(self) -> None:
        """Idempotent: a SIGTERM drain stops the server, then uvicorn's lifespan exit calls it again."""
        if self._stopping:
            return
        self._stopping = True
        self._wake.set()
        for task in [*self._recoveries.values(), *self._transfers]:
            task.cancel()
        if self._task is not None:
            await self._task
        await asyncio.gather(*self._transfers, return_exceptions=True)
        for client in self.clients:
            client.close()

    async def readiness(self, ping_timeout_s: float = 2.0) -> str | None:
        """Why the server cannot take requests now (every agent is pinged); None when it can."""
        if self.scheduler is None:
            return "not started: waiting for the agents"
        if self._draining or self._stopping:
            return "shutting down"
        pings = await asyncio.gather(*(c.ping(ping_timeout_s) for c in self.clients), return_exceptions=True)
        down = []
        for client, ok, ping in zip(self.clients, self.scheduler.healthy, pings):
            answering = ok and not isinstance(ping, BaseException)
            self.metrics.agent_up.labels(client.address).set(int(answering))
            if not answering:
                down.append(client.address)
        return f"agents not answering: {', '.join(down)}" if down else None

    def get_bs_current(self, group: int | None = None) -> int:
        """Running sequences, in total or of one group (a replica: one agent, for now)."""
        if self.scheduler is None:
            return 0
        if group is None:
            return self.scheduler.num_running
        return sum(1 for seq in self.scheduler.running.values() if seq.agent == group)

    def group_slots(self, group: int) -> int:
        """KV slots of a group while it is healthy, else 0."""
        if self.scheduler is None or not self.scheduler.healthy[group]:
            return 0
        return self.capacities[group].num_slots

    def get_queue_current(self) -> int:
        return self.scheduler.num_waiting if self.scheduler else 0

    # -------------------------------------------------------------------------------- requests

    def generate_answer(self, request_id: str, prompt: list[int], sampling: SamplingParams,
                        max_new_tokens: int, stop: tuple[str, ...] = (),
                        ignore_eos: bool = False) -> AnswerStream:
        """Registers the request at once (AdmissionError if it is refused) and returns its stream.
        Closing the stream early (client gone) aborts the request and frees its slot."""
        if self.scheduler is None or self._draining or self._stopping:
            raise AdmissionError("the server is shutting down" if self.scheduler else
                                 "the server is not ready", 503)
        seq = Sequence(request_id, list(prompt), sampling, max_new_tokens,
                       frozenset() if ignore_eos else self.stop_ids)
        try:
            self.scheduler.add(seq)
        except AdmissionError:
            self.metrics.requests.labels("rejected").inc()
            raise
        self.metrics.prompt_tokens.inc(len(seq.prompt))
        stop = tuple(s for s in stop if s)
        stream = _Stream(seq, asyncio.Queue(), IncrementalDetokenizer(self.tokenizer), stop,
                         hold=max((len(s) for s in stop), default=1) - 1)
        self.streams[request_id] = stream
        self._wake.set()
        return AnswerStream(self, stream)

    def _close(self, stream: _Stream) -> None:
        """The reader is done with the stream: an unfinished request is aborted, its slot freed."""
        if not stream.seq.finished:
            self.scheduler.abort(stream.seq.request_id)
            self._wake.set()
            self._count(stream)
        self.streams.pop(stream.seq.request_id, None)

    # ---------------------------------------------------------------------------- the loop

    async def _run(self) -> None:
        while not self._stopping:
            plan = self.scheduler.schedule()
            if plan.empty:
                self._wake.clear()
                await self._wake.wait()
                continue
            try:
                await self._step(plan)
            except Exception as exc:  # a bug must not leave every request hanging
                log.exception("scheduler step failed")
                self._fail(plan.prefills + [s for seqs in plan.decodes.values() for s in seqs],
                           f"internal error: {type(exc).__name__}: {exc}")
        for stream in list(self.streams.values()):  # stop(): end what is still open
            stream.seq.error = "the server is shutting down"
            self.scheduler.finish(stream.seq, FinishReason.ABORT)
            self._emit(stream.seq)

    async def _step(self, plan: StepPlan) -> None:
        """Run one plan: releases, then prefills, then one decode per agent (agents in parallel)."""
        for agent, slot, ticket in plan.releases:
            await self._call(agent, self.clients[agent].release(slot, ticket))
        for seq in plan.prefills:
            if seq.prefill_agent is not None and seq.finished:  # aborted before its prefill ran
                self.scheduler.transfer_failed(seq, "aborted")
            elif seq.prefill_agent is not None:
                task = asyncio.create_task(self._prefill_elsewhere(seq), name=f"prefill-{seq.request_id}")
                self._transfers.add(task)
                task.add_done_callback(self._transfers.discard)
                continue
            if seq.finished:  # aborted, or its agent failed earlier in this plan
                continue
            try:
                with self.metrics.agent_step.labels(self.clients[seq.agent].address, "prefill").time():
                    token = await self.clients[seq.agent].prefill(seq.slot, seq.prompt, seq.sampling)
            except AgentRequestError as exc:  # this request was bad; the agent is fine
                self._fail([seq], str(exc))
                continue
            except AgentError as exc:
                self._agent_failed(seq.agent, exc)
                continue
            self.scheduler.prefilled(seq, token)
            self._emit(seq)
        decodes = [(agent, seqs) for agent, seqs in plan.decodes.items()
                   if self.scheduler.healthy[agent]]
        results = await asyncio.gather(*(self._decode(agent, seqs) for agent, seqs in decodes),
                                       return_exceptions=True)
        for (agent, seqs), result in zip(decodes, results):
            if isinstance(result, BaseException):
                self._agent_failed(agent, result)
                continue
            self.scheduler.decoded(seqs, result)
            for seq in seqs:
                self._emit(seq)

    async def _prefill_elsewhere(self, seq: Sequence) -> None:
        """PD disaggregation: the prefill agent computes the prompt and sends its KV straight to
        the decode agent's slot; the sequence decodes there from the next step on."""
        prefill, decode = self.clients[seq.prefill_agent], self.clients[seq.agent]
        transfer = {"address": decode.address, "slot": seq.slot, "session": decode.session,
                    "ticket": seq.ticket}
        try:
            with self.metrics.agent_step.labels(prefill.address, "prefill").time():
                token, kv_bytes, transfer_ms = await prefill.prefill_and_send(
                    seq.prefill_slot, seq.prompt, seq.sampling, transfer)
        except AgentRequestError as exc:  # this request failed (its KV did not arrive); the agent is fine
            log.warning("request %s failed on %s: %s", seq.request_id, prefill.address, exc)
            self.scheduler.transfer_failed(seq, str(exc))
            self._emit(seq)
        except AgentError as exc:
            self._agent_failed(seq.prefill_agent, exc)  # fails seq too
            self.scheduler.transfer_failed(seq, str(exc))
        else:
            self.metrics.kv_transfer_bytes.inc(kv_bytes)
            self.metrics.kv_transfer.observe(transfer_ms / 1000)
            log.debug("request %s: KV of %d tokens (%d bytes) moved to %s slot %d in %.1f ms",
                      seq.request_id, len(seq.prompt), kv_bytes, decode.address, seq.slot, transfer_ms)
            self.scheduler.transferred(seq, token)
            self._emit(seq)
        self._wake.set()

    def _fail(self, seqs: list[Sequence], error: str) -> None:
        for seq in seqs:
            if not seq.finished:
                seq.error = error
                self.scheduler.finish(seq, FinishReason.ERROR)
                self._emit(seq)

    async def _decode(self, agent: int, seqs: list[Sequence]) -> list[int]:
        client = self.clients[agent]
        with self.metrics.agent_step.labels(client.address, "decode").time():
            tokens = await client.decode([s.slot for s in seqs])
        self.metrics.agent_compute.labels(client.address, "decode").observe(client.decode_compute_s)
        return tokens

    async def _call(self, agent: int, call) -> None:
        try:
            await call
        except AgentError as exc:
            self._agent_failed(agent, exc)

    def _agent_failed(self, agent: int, exc: BaseException) -> None:
        if not self.scheduler.healthy[agent]:
            return
        address = self.clients[agent].address
        log.error("agent %s failed: %s", address, exc)
        self.metrics.agent_up.labels(address).set(0)
        failed = self.scheduler.agent_failed(agent, f"agent {address} failed: {exc}")
        if not self.scheduler.can_serve:
            failed += self.scheduler.fail_waiting(f"no agent is available: {address} failed: {exc}")
        for seq in failed:
            self._emit(seq)
        if not self._stopping:
            self._recoveries[agent] = asyncio.create_task(self._recover(agent),
                                                          name=f"recover-agent-{agent}")

    async def _recover(self, agent: int) -> None:
        """Probe a failed agent until it answers (restarted by the launcher, or resumed), then
        give its slots back to the scheduler. Fresh socket per probe: nothing queued for a dead
        connection is ever delivered."""
        client, last_reason = self.clients[agent], None
        while not self._stopping:
            client.reconnect()
            try:
                capacity = await self._connect(agent, client, RECOVERY_PROBE_S)
            except AgentError as exc:
                if str(exc) != last_reason:
                    last_reason = str(exc)
                    log.warning("agent %s not back yet: %s", client.address, exc)
                await asyncio.sleep(RECOVERY_INTERVAL_S)
                continue
            self.capacities[agent] = capacity
            self.scheduler.agent_recovered(agent, capacity)
            self.metrics.agent_up.labels(client.address).set(1)
            log.info("agent %s is back: serving on it again", client.address)
            self._recoveries.pop(agent, None)
            self._wake.set()
            return

    def _emit(self, seq: Sequence) -> None:
        """Hand the sequence's newest token (as text) and/or its end to its stream."""
        stream = self.streams.get(seq.request_id)
        if stream is None:
            return
        new_tokens = seq.output[stream.consumed:]
        stream.consumed = len(seq.output)
        for token in new_tokens:
            if token not in self.stop_ids:  # EOS ends the answer; it is not part of the text
                stream.detokenizer.add(token)
        if seq.finished:
            stream.detokenizer.flush()
        text = stream.detokenizer.text
        hits = [i for i in (text.find(s, max(0, stream.sent - len(s))) for s in stream.stop) if i >= 0]
        if hits:
            text = text[:min(hits)]
            self.scheduler.finish(seq, FinishReason.STOP)
        elif stream.hold and not seq.finished:
            # Hold back what could be the start of a stop string: once sent it cannot be taken back.
            text = text[:max(stream.sent, len(text) - stream.hold)]
        piece, stream.sent = text[stream.sent:], len(text)
        if new_tokens:
            now = time.monotonic()
            self.metrics.generated_tokens.inc(len(new_tokens))
            if stream.last_token is None:
                self.metrics.ttft.observe(now - stream.admitted)
            else:
                self.metrics.inter_token.observe(now - stream.last_token)
            stream.last_token = now
        if seq.finished:
            self._count(stream)
        stream.queue.put_nowait(GenerationOutput(
            text=piece, token_id=new_tokens[-1] if new_tokens else None, index=len(seq.output), finished=seq.finished,
            finish_reason=seq.finish_reason.value if seq.finished else None, error=seq.error))

    def _count(self, stream: _Stream) -> None:
        """A request's outcome and duration, once."""
        if stream.counted:
            return
        stream.counted = True
        reason = stream.seq.finish_reason
        outcome = ("ok" if reason in (FinishReason.STOP, FinishReason.LENGTH) else
                   "error" if reason is FinishReason.ERROR or stream.seq.error else "aborted")
        self.metrics.requests.labels(outcome).inc()
        if outcome == "ok":
            self.metrics.e2e.observe(time.monotonic() - stream.admitted)
