"""The engine loop (scheduler/engine.py) over a fake agent client: no process, no socket. The fake
answers as an agent would, by the contract (agent/contract/step.py, protocol.py): each sampled
token is the last token + 1, so every answer is known in advance; it can fail one sequence's
choice, or fail as a whole group."""

from __future__ import annotations

import asyncio

from agent.contract.sampling import NO_TOKEN, Sampled, SamplingParams, SequenceFault
from agent.contract.step import StepChunk, StepRequest
from agent.contract.step_reply import StepReply
from config.schema import ServingConfig
from scheduler.agent_client import AgentUnavailable
from scheduler.engine import Engine
from scheduler.engine_io import EngineOutput, EngineRequest, FaultKind, FinishReason
from waiting import wait_until_async

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
            "max_proposals": 16,
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

    async def step(self, request: StepRequest) -> StepReply:
        await self._check()
        decoded = []
        for slot in request.slots:  # a proposal is kept where it is the next token (last + 1)
            tokens = [self._next(slot)]
            for proposal in request.drafts.get(slot, []):
                if tokens[-1].token != proposal:
                    break
                tokens.append(self._next(slot))
            decoded.append(tokens)
        return StepReply(decoded, [self._chunk(c) for c in request.chunks])

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


class Answers:
    """What the engine reported of each request through process_outputs, as a front end sees it;
    `decide(answers, output)` plays the output layer's finish decision (a stop string)."""

    def __init__(self, decide=None):
        self.tokens: dict[str, list[int]] = {}
        self.ends: dict[str, EngineOutput] = {}
        self.decide = decide

    def process(self, outputs: list[EngineOutput]) -> list[str]:
        stopped = []
        for output in outputs:
            assert output.request_id not in self.ends, "a request ends once"
            self.tokens.setdefault(output.request_id, []).extend(output.new_token_ids)
            if output.finished:
                self.ends[output.request_id] = output
            if self.decide and self.decide(self, output) is FinishReason.STOP:
                stopped.append(output.request_id)
        return stopped

    def finished(self, *request_ids: str) -> bool:
        return all(r in self.ends for r in request_ids)


def engine_over(agent: FakeAgent, answers: Answers) -> Engine:
    config = ServingConfig.model_validate({"agents": {"ports": [1]}, "server": {"agent_wait_s": 1}})
    engine = Engine(config, VOCAB, [EOS], answers.process)
    engine.links.clients[0] = agent  # the engine's list: the fake stands in for the agent client
    return engine


def submit(engine: Engine, request_id: str, prompt: list[int], sampling: SamplingParams, max_new_tokens: int):
    engine.add_request(
        EngineRequest(
            request_id=request_id, prompt=tuple(prompt), sampling=sampling, max_new_tokens=max_new_tokens
        )
    )


def test_requests_decode_to_their_length_and_free_their_slots():
    agent, answers = FakeAgent(), Answers()

    async def scenario():
        engine = engine_over(agent, answers)
        await engine.start()
        for i in range(6):
            submit(engine, f"r{i}", [10 * i + 1, 10 * i + 2], SamplingParams(), 5)
        await wait_until_async(
            lambda: answers.finished(*(f"r{i}" for i in range(6))), 5, "the six requests finished"
        )
        # the last releases: the next iteration
        await wait_until_async(lambda: len(agent.released) == 6, 5, "every slot released")
        await engine.stop()

    run(scenario())
    for i in range(6):
        first = 10 * i + 3
        assert answers.tokens[f"r{i}"] == list(range(first, first + 5))
        assert answers.ends[f"r{i}"].finish_reason is FinishReason.LENGTH
    assert set(agent.released) <= set(range(4))  # 6 requests over 4 slots: reused


def test_a_slot_release_is_pending_until_its_agent_answers_it():
    """releases_pending (the groups' field in /info): a finished sequence's release counts from its
    end, while planned and while its agent has not answered, and no longer once it has."""
    agent, answers = FakeAgent(), Answers()
    answer_release = asyncio.Event()
    release = agent.release

    async def held_release(slot: int, ticket=None) -> None:
        await answer_release.wait()
        await release(slot, ticket)

    agent.release = held_release

    async def scenario():
        engine = engine_over(agent, answers)
        await engine.start()
        submit(engine, "r", [1, 2], SamplingParams(), 3)
        await wait_until_async(lambda: answers.finished("r"), 5, "r finished")
        assert engine.stats().groups[0].releases_pending == 1  # not yet planned
        await wait_until_async(lambda: engine.executor.releasing[0] == 1, 5, "r's release sent to the agent")
        assert (
            engine.stats().groups[0].releases_pending == 1 and agent.released == []
        )  # planned, not answered
        answer_release.set()
        await wait_until_async(
            lambda: engine.stats().groups[0].releases_pending == 0, 5, "r's release answered"
        )
        assert agent.released == [0]
        await engine.stop()

    run(scenario())


def test_a_sequence_fault_ends_that_sequence_alone():
    agent, answers = FakeAgent(), Answers()

    async def scenario():
        engine = engine_over(agent, answers)
        await engine.start()
        submit(engine, "faulty", [1, 2], FAULTY, 8)
        submit(engine, "fine", [3, 4], SamplingParams(), 8)
        await wait_until_async(lambda: answers.finished("faulty", "fine"), 5, "both requests finished")
        await engine.stop()

    run(scenario())
    faulty, fine = answers.ends["faulty"], answers.ends["fine"]
    assert faulty.finish_reason is FinishReason.ERROR and faulty.fault is FaultKind.REQUEST
    assert "nothing to sample" in (faulty.error or "") and answers.tokens["faulty"] == []
    assert fine.finish_reason is FinishReason.LENGTH and answers.tokens["fine"] == list(range(5, 13))
    assert fine.fault is None and fine.error is None


def test_a_dead_group_fails_its_sequences_and_serves_again_once_it_answers():
    agent, answers = FakeAgent(), Answers()

    async def scenario():
        engine = engine_over(agent, answers)
        await engine.start()
        submit(engine, "before", [1, 2], SamplingParams(), 40)
        await wait_until_async(lambda: len(answers.tokens.get("before", [])) >= 3, 5, "3 tokens of before")
        agent.down = True
        await wait_until_async(lambda: answers.finished("before"), 5, "before finished")
        agent.down = False
        # the engine probes a failed group every second
        await wait_until_async(lambda: engine.stats().groups[0].healthy, 5, "the group healthy again")
        submit(engine, "after", [20], SamplingParams(), 3)
        await wait_until_async(lambda: answers.finished("after"), 5, "after finished")
        await engine.stop()

    run(scenario())
    before = answers.ends["before"]
    assert before.finish_reason is FinishReason.ERROR and before.fault is FaultKind.UNAVAILABLE
    assert "fake agent is down" in (before.error or "")
    assert answers.tokens["after"] == [21, 22, 23]


def test_a_finish_the_output_layer_decides_is_applied():
    """process_outputs returns the request once the text holds a stop string (server/output.py): here, at the
    answer's third token; the engine ends the request there, reports that end once, and frees
    its slot."""
    agent = FakeAgent()

    def stop_at_third(answers: Answers, output: EngineOutput) -> FinishReason | None:
        return FinishReason.STOP if len(answers.tokens["stops"]) == 3 and not output.finished else None

    answers = Answers(stop_at_third)

    async def scenario():
        engine = engine_over(agent, answers)
        await engine.start()
        submit(engine, "stops", [1], SamplingParams(), 30)
        await wait_until_async(lambda: answers.finished("stops"), 5, "stops finished")
        await wait_until_async(lambda: agent.released, 5, "a slot released")
        await engine.stop()

    run(scenario())
    assert answers.ends["stops"].finish_reason is FinishReason.STOP and answers.tokens["stops"] == [2, 3, 4]
    assert len(agent.released) == 1


def test_an_aborted_request_reports_its_end():
    """The client went away (the stream's close aborts it): the engine reports the request's end
    at once, so the front end hears of every request's end from the engine."""
    agent, answers = FakeAgent(), Answers()

    async def scenario():
        engine = engine_over(agent, answers)
        await engine.start()
        submit(engine, "gone", [1], SamplingParams(), 1000)
        await wait_until_async(lambda: len(answers.tokens.get("gone", [])) >= 2, 5, "2 tokens of gone")
        engine.abort("gone")
        assert answers.ends["gone"].finish_reason is FinishReason.ABORT
        await wait_until_async(lambda: agent.released, 5, "a slot released")
        await engine.stop()

    run(scenario())


def run(coro):
    return asyncio.run(coro)


def test_dropping_the_prefix_cache_under_load_waits_for_a_step_not_for_the_load():
    """The group is planned no step while its pool drops (the step in flight ends first); with
    sequences decoding, the drop answers within a step, not once they are done."""
    agent, answers = FakeAgent(), Answers()

    async def scenario():
        engine = engine_over(agent, answers)
        await engine.start()
        submit(engine, "long", [1, 2, 3, 4, 5], SamplingParams(), 55)
        submit(engine, "short", [6, 7, 8, 9, 10], SamplingParams(), 2)
        await wait_until_async(
            lambda: answers.finished("short") and len(answers.tokens.get("long", [])) > 2,
            5,
            "short finished and 3 tokens of long",
        )
        dropped = await asyncio.wait_for(engine.drop_prefix_cache(), 2)
        assert not answers.finished("long")
        assert dropped["pool_blocks"] >= 2 and dropped["tier_blocks"] == 0 and dropped["skipped_groups"] == []
        assert engine.stats().groups[0].kv_blocks.cached == 0
        await wait_until_async(lambda: answers.finished("long"), 5, "long finished")
        await engine.stop()

    run(scenario())
    assert answers.tokens["long"] == list(range(6, 61))  # the running sequence went on as it was


def test_proposal_costs_are_learned_from_the_steps_round_trips():
    """The proposal lengths weigh a step's extra tokens against what a step costs the scheduler:
    its whole round trip, not the agent's compute alone (which leaves out ZeroMQ and
    (de)serialising, and made proposals look dearer than they are). The fake reports 1 ms of
    compute for steps that take at least 2 ms (its sleep)."""
    agent, answers = FakeAgent(), Answers()

    async def scenario():
        engine = engine_over(agent, answers)
        await engine.start()
        # the answer counts up (last + 1): the prompt's "2, 3" recurs, so some steps verify proposals
        submit(engine, "r", [1, 2, 3, 1, 2], SamplingParams(), 12)
        await wait_until_async(lambda: answers.finished("r"), 5, "r finished")
        await engine.stop()
        return engine.scheduler.verify_costs[0]

    costs = run(scenario())
    assert costs.known  # plain steps and verifying ones were both measured
    step_s = costs.decode_s(1)
    assert step_s is not None and step_s >= 0.002 > agent.decode_compute_s
