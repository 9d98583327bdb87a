"""The engine loop (scheduler/engine.py) over a fake agent client: no process, no socket. The fake
answers as an agent would, by the contract (agent/contract/step.py, protocol.py): each sampled
token is the last token + 1, so every answer is known in advance; it can fail one sequence's
choice, or fail as a whole group."""

from __future__ import annotations

import asyncio

from agent.contract.sampling import NO_TOKEN, Sampled, SamplingParams, SequenceFault
from agent.contract.step import StepChunk
from config.schema import ServingConfig
from scheduler.agent_client import AgentUnavailable
from scheduler.engine import Engine
from scheduler.sequence import FinishReason, Sequence

VOCAB, EOS = 100, 0
FAULTY = SamplingParams(min_tokens=7)  # the fake fails the choices of sequences sampling so


class FakeAgent:
    """One agent group's client; `down`: every call fails as a dead agent's would."""

    def __init__(self, slots: int = 4, max_len: int = 64, block_size: int = 4):
        self.address, self.session, self.lost, self.decode_compute_s = "fake", 1, None, 0.001
        self.info_reply = {
            "vocab_size": VOCAB,
            "eos_ids": [EOS],
            "role": "mixed",
            "model": "fake",
            "num_slots": slots,
            "max_seq_len": max_len,
            "num_blocks": slots * max_len // block_size,
            "block_size": block_size,
            "max_chunk": 32,
            "chunked_prefill": True,
            "mixed_rows": 32,
            "decode_batch_buckets": [slots],
        }
        self.last: dict[int, int] = {}  # slot -> its last token
        self.faulty: set[int] = set()  # slots whose sequence samples FAULTY
        self.released: list[int] = []
        self.down = False

    async def _check(self) -> None:
        await asyncio.sleep(0.002)  # a step takes a while, as an agent's does
        if self.down:
            raise AgentUnavailable("fake agent is down")

    def _next(self, slot: int) -> Sampled:
        if slot in self.faulty:
            return Sampled(NO_TOKEN, None, SequenceFault("request", f"slot {slot} has nothing to sample"))
        self.last[slot] = (self.last[slot] + 1) % VOCAB
        return Sampled(self.last[slot])

    def _chunk(self, chunk: StepChunk) -> Sampled | None:
        if chunk.sampling is None:
            return None
        self.last[chunk.slot] = chunk.tokens[-1]
        if chunk.sampling == FAULTY:
            self.faulty.add(chunk.slot)
        return self._next(chunk.slot)

    async def info(self, timeout_s=None) -> dict:
        await self._check()
        return dict(self.info_reply)

    async def reset(self, timeout_s=None) -> None:
        await self._check()
        self.last.clear()

    async def prefill(self, chunk: StepChunk, mask=None) -> Sampled | None:
        await self._check()
        return self._chunk(chunk)

    async def decode(self, slots, tables, masks=None) -> list[Sampled]:
        await self._check()
        return [self._next(slot) for slot in slots]

    async def step(self, slots, tables, chunks, masks=None, drafts=None):
        await self._check()
        drafts = drafts or {}
        decoded = []
        for slot in slots:  # a proposal is kept where it is the next token (last + 1)
            tokens = [self._next(slot)]
            for proposal in drafts.get(slot, []):
                if tokens[-1].token != proposal:
                    break
                tokens.append(self._next(slot))
            decoded.append(tokens)
        return decoded, [self._chunk(c) for c in chunks]

    async def release(self, slot: int, ticket=None) -> None:
        await self._check()
        self.released.append(slot)
        self.faulty.discard(slot)

    async def ping(self, timeout_s=None) -> None:
        await self._check()

    def reconnect(self) -> None:
        pass

    def close(self) -> None:
        pass


def engine_over(agent: FakeAgent, on_update=lambda seq: None) -> Engine:
    config = ServingConfig.model_validate({"agents": {"ports": [1]}, "server": {"agent_wait_s": 1}})
    engine = Engine(config, VOCAB, [EOS], on_update)
    engine.links.clients[0] = agent  # the engine's list: the fake stands in for the agent client
    return engine


async def until(condition, timeout_s: float = 5) -> None:
    """Waits for `condition()` to hold (a barrier on the state, not on time)."""

    async def holds():
        while not condition():
            await asyncio.sleep(0.01)

    await asyncio.wait_for(holds(), timeout_s)


async def finished(seqs: list[Sequence], timeout_s: float = 5) -> None:
    await until(lambda: all(s.finished for s in seqs), timeout_s)


def test_requests_decode_to_their_length_and_free_their_slots():
    agent = FakeAgent()

    async def scenario():
        engine = engine_over(agent)
        await engine.start()
        seqs = [engine.add_request(f"r{i}", [10 * i + 1, 10 * i + 2], SamplingParams(), 5) for i in range(6)]
        await finished(seqs)
        await until(lambda: len(agent.released) == len(seqs))  # the last releases: the next iteration
        await engine.stop()
        return seqs

    seqs = run(scenario())
    for i, seq in enumerate(seqs):
        first = 10 * i + 3
        assert seq.output == list(range(first, first + 5)) and seq.finish_reason is FinishReason.LENGTH
    assert sorted(agent.released) == sorted(s.slot for s in seqs)  # 6 requests over 4 slots: reused


def test_a_sequence_fault_ends_that_sequence_alone():
    agent = FakeAgent()

    async def scenario():
        engine = engine_over(agent)
        await engine.start()
        faulty = engine.add_request("faulty", [1, 2], FAULTY, 8)
        fine = engine.add_request("fine", [3, 4], SamplingParams(), 8)
        await finished([faulty, fine])
        await engine.stop()
        return faulty, fine

    faulty, fine = run(scenario())
    assert faulty.finish_reason is FinishReason.ERROR and faulty.error_status == 400
    assert "nothing to sample" in (faulty.error or "") and faulty.output == []
    assert fine.finish_reason is FinishReason.LENGTH and fine.output == list(range(5, 13))


def test_a_dead_group_fails_its_sequences_and_serves_again_once_it_answers():
    agent = FakeAgent()

    async def scenario():
        engine = engine_over(agent)
        await engine.start()
        before = engine.add_request("before", [1, 2], SamplingParams(), 40)
        await until(lambda: len(before.output) >= 3)
        agent.down = True
        await finished([before])
        agent.down = False
        await until(lambda: engine.scheduler.healthy[0])  # the engine probes a failed group every second
        after = engine.add_request("after", [20], SamplingParams(), 3)
        await finished([after])
        await engine.stop()
        return before, after

    before, after = run(scenario())
    assert before.finish_reason is FinishReason.ERROR and before.error_status == 503
    assert "fake agent is down" in (before.error or "")
    assert after.output == [21, 22, 23]


def test_a_finish_the_output_layer_decides_is_applied():
    """on_update returns STOP once the text holds a stop string (server/output.py): here, at the
    answer's third token; the engine ends the sequence there and frees its slot."""
    agent = FakeAgent()

    def stop_at_third(seq: Sequence) -> FinishReason | None:
        return FinishReason.STOP if len(seq.output) == 3 and not seq.finished else None

    async def scenario():
        engine = engine_over(agent, stop_at_third)
        await engine.start()
        seq = engine.add_request("stops", [1], SamplingParams(), 30)
        await finished([seq])
        await until(lambda: agent.released)
        await engine.stop()
        return seq

    seq = run(scenario())
    assert seq.finish_reason is FinishReason.STOP and seq.output == [2, 3, 4]
    assert agent.released == [seq.slot]


def run(coro):
    return asyncio.run(coro)
