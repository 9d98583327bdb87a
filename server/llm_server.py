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
parallel). Detokenization and stop strings happen here, on the server side; agents see token ids only.
"""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import AsyncIterator

from agent.sampling import SamplingParams
from config.schema import ServingConfig
from scheduler.agent_client import AgentClient, AgentError, AgentRequestError
from scheduler.batch_scheduler import AdmissionError, AgentCapacity, BatchScheduler
from scheduler.sequence import FinishReason, Sequence
from server.detokenizer import IncrementalDetokenizer
from server.metrics import ServingMetrics
from server.tokenizer import TextTokenizer

log = logging.getLogger(__name__)


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


class LLMServer:
    def __init__(self, config: ServingConfig, tokenizer: TextTokenizer,
                 metrics: ServingMetrics | None = None):
        self.config = config
        self.tokenizer = tokenizer
        self.metrics = metrics or ServingMetrics()
        host = config.agents.host
        self.clients = [AgentClient(f"tcp://{host}:{port}", config.server.agent_timeout_s)
                        for port in config.agents.ports]
        self.scheduler: BatchScheduler | None = None
        self.streams: dict[str, _Stream] = {}
        self.stop_ids: frozenset[int] = frozenset(tokenizer.eos_ids)
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._draining = False
        self._stopping = False
        self.capacities: list[AgentCapacity] = []
        m = self.metrics
        m.running.set_function(self.get_bs_current)
        m.waiting.set_function(self.get_queue_current)
        m.slots_used.set_function(self.get_bs_current)
        m.slots_total.set_function(lambda: sum(
            c.num_slots for c, ok in zip(self.capacities, self.scheduler.healthy) if ok) if self.scheduler else 0)

    # ------------------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        self.capacities = [await self._wait_for_agent(i, c) for i, c in enumerate(self.clients)]
        for client in self.clients:
            self.metrics.agent_up.labels(client.address).set(1)
        self.scheduler = BatchScheduler(self.capacities, self.config.server.max_waiting_requests,
                                        self.config.server.max_prefills_per_step)
        self._task = asyncio.create_task(self._run(), name="scheduler-loop")

    async def _wait_for_agent(self, index: int, client: AgentClient) -> AgentCapacity:
        deadline = time.monotonic() + self.config.server.agent_wait_s
        while True:
            try:
                info = await client.info()
                break
            except AgentError as exc:
                if time.monotonic() > deadline:
                    raise AgentError(f"agent {client.address} not answering after "
                                     f"{self.config.server.agent_wait_s:g}s: {exc}") from exc
                log.info("waiting for agent %s (%s)", client.address, exc)
        # This server owns every slot: one a previous server left in use would refuse its prefill.
        for slot in range(info["num_slots"]):
            await client.release(slot)
        self.stop_ids |= frozenset(info["eos_ids"])
        if info["vocab_size"] < self.tokenizer.vocab_size:
            raise AgentError(f"agent {client.address} serves a vocabulary of {info['vocab_size']} "
                             f"tokens; the tokenizer has {self.tokenizer.vocab_size}")
        log.info("agent %d at %s: model %s, %d slots, max length %d", index, client.address,
                 info["model"], info["num_slots"], info["max_seq_len"])
        return AgentCapacity(info["num_slots"], info["max_seq_len"], info["max_prompt_len"])

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
        self._stopping = True
        self._wake.set()
        if self._task is not None:
            await self._task
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

    def get_bs_current(self) -> int:
        return self.scheduler.num_running if self.scheduler else 0

    def get_queue_current(self) -> int:
        return self.scheduler.num_waiting if self.scheduler else 0

    # -------------------------------------------------------------------------------- requests

    def generate_answer(self, request_id: str, prompt: list[int], sampling: SamplingParams,
                        max_new_tokens: int, stop: tuple[str, ...] = (),
                        ignore_eos: bool = False) -> AsyncIterator[GenerationOutput]:
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
        return self._read(stream)

    async def _read(self, stream: _Stream) -> AsyncIterator[GenerationOutput]:
        try:
            while True:
                output = await stream.queue.get()
                yield output
                if output.finished:
                    return
        finally:
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
            for agent, slot in plan.releases:
                await self._call(agent, self.clients[agent].release(slot))
            for seq in plan.prefills:
                if seq.finished:  # aborted, or its agent failed earlier in this plan
                    continue
                try:
                    with self.metrics.agent_step.labels(self.clients[seq.agent].address, "prefill").time():
                        token = await self.clients[seq.agent].prefill(seq.slot, seq.prompt, seq.sampling)
                except AgentRequestError as exc:  # this request was bad; the agent is fine
                    seq.error = str(exc)
                    self.scheduler.finish(seq, FinishReason.ERROR)
                    self._emit(seq)
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
        for stream in list(self.streams.values()):  # stop(): end what is still open
            stream.seq.error = "the server is shutting down"
            self.scheduler.finish(stream.seq, FinishReason.ABORT)
            self._emit(stream.seq)

    async def _decode(self, agent: int, seqs: list[Sequence]) -> list[int]:
        with self.metrics.agent_step.labels(self.clients[agent].address, "decode").time():
            return await self.clients[agent].decode([s.slot for s in seqs])

    async def _call(self, agent: int, call) -> None:
        try:
            await call
        except AgentError as exc:
            self._agent_failed(agent, exc)

    def _agent_failed(self, agent: int, exc: BaseException) -> None:
        if not self.scheduler.healthy[agent]:
            return
        log.error("agent %s failed: %s", self.clients[agent].address, exc)
        self.metrics.agent_up.labels(self.clients[agent].address).set(0)
        for seq in self.scheduler.agent_failed(agent, str(exc)):
            self._emit(seq)

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
