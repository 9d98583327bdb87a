"""The engine and its answer streams (OutputProcessor), built side by side, over a real agent
process: streams, continuous batching, aborts, stop strings, limits."""

import asyncio
import gc
import sys

import pytest

import runner_calls as calls
from agent.contract.sampling import SamplingParams
from agent.model.tokenizer import load_tokenizer
from agent_harness import LauncherProcess, free_ports, write_config
from config import load_config
from engine_harness import EngineAndStreams
from scheduler.engine_io import AdmissionError, Refusal
from scheduler.sequence import FinishReason
from server.errors import OPENAI, refusal_status
from waiting import wait_until_async

GREEDY = SamplingParams()
TEXTS = [
    "The quick brown fox",
    "你好，世界！",
    "emoji 😀 🎉",
    "Numbers 0123",
    "café naïve",
    "The capital of France",
]


@pytest.fixture(scope="module")
def agent_config(tmp_path_factory, tiny_llama_dir):
    directory = tmp_path_factory.mktemp("llm-server")
    path = write_config(
        directory,
        tiny_llama_dir,
        free_ports(1),
        server={"agent_timeout_s": 20},
        scheduler={"max_waiting_requests": 8},
        # one token an output: the tests count outputs by index (a verified step's tokens come as one)
        runtime={"speculation": {"method": "none"}},
    )
    launcher = LauncherProcess(path)
    try:
        launcher.wait_for("all agents started", 240)
        yield load_config(path)
    finally:
        launcher.close()


@pytest.fixture(scope="module")
def tokenizer(tiny_llama_dir):
    return load_tokenizer(tiny_llama_dir)


def run(coro):
    return asyncio.run(coro)


async def collect(stream):
    outputs = [out async for out in stream]
    return "".join(o.text for o in outputs), outputs


def alone(runner, prompt, n, stop_ids):
    """Reference answer: the in-process runner, stopping at EOS like the server."""
    tokens = [calls.prefill(runner, 0, prompt, GREEDY)]
    while tokens[-1] not in stop_ids and len(tokens) < n:
        tokens += calls.decode(runner, [0])
    runner.release(0)
    return [t for t in tokens if t not in stop_ids]


def test_answers_under_load_equal_answers_alone(agent_config, tokenizer, tiny_llama_runner, release_all):
    release_all(tiny_llama_runner)
    prompts = [tokenizer.encode(t) for t in TEXTS]
    stop_ids = set(tokenizer.eos_ids)
    want = [tokenizer.decode(alone(tiny_llama_runner, p, 20, stop_ids)) for p in prompts]

    async def scenario():
        server = EngineAndStreams(agent_config, tokenizer)
        await server.engine.start()
        seen = {"bs": 0, "queue": 0}

        async def watch():
            while True:
                seen["bs"] = max(seen["bs"], server.engine.stats().running)
                seen["queue"] = max(seen["queue"], server.engine.stats().waiting)
                await asyncio.sleep(0.005)  # the watcher's sampling interval

        watcher = asyncio.create_task(watch())
        # 6 requests, 4 slots: two must wait in the queue and enter as slots free up.
        results = await asyncio.gather(
            *(collect(server.generate_answer(f"r{i}", p, GREEDY, 20)) for i, p in enumerate(prompts[:3])),
            *(collect(server.generate_answer(f"s{i}", p, GREEDY, 20)) for i, p in enumerate(prompts[3:])),
        )
        watcher.cancel()
        await server.engine.stop()
        return results, seen

    results, seen = run(scenario())
    assert [text for text, _ in results] == want
    assert seen["bs"] == 4 and seen["queue"] >= 1
    for _, outputs in results:  # (split characters: see test_tokenizer; a random model may
        # emit invalid byte sequences, which the reference decode holds too)
        assert outputs[-1].finished and outputs[-1].finish_reason in ("stop", "length")
        assert [o.index for o in outputs] == list(range(1, len(outputs) + 1))


def test_closing_a_stream_aborts_and_frees_the_slot(agent_config, tokenizer):
    async def scenario():
        server = EngineAndStreams(agent_config, tokenizer)
        await server.engine.start()
        stream = server.generate_answer("gone", tokenizer.encode("The quick"), GREEDY, 60)
        await stream.__anext__()
        assert server.engine.stats().running == 1
        await stream.aclose()  # what a disconnecting HTTP client does to its generator
        await wait_until_async(lambda: server.engine.stats().running == 0, 5, "the slot freed")
        bs = server.engine.stats().running
        # The freed slot is usable again: four new requests fill all four slots.
        texts = await asyncio.gather(
            *(collect(server.generate_answer(f"n{i}", [5 + i], GREEDY, 5)) for i in range(4))
        )
        await server.engine.stop()
        return bs, texts

    bs, texts = run(scenario())
    assert bs == 0 and len(texts) == 4


def test_stop_string_truncates_and_finishes(agent_config, tokenizer, tiny_llama_runner, release_all):
    release_all(tiny_llama_runner)
    prompt = tokenizer.encode("The capital of France")
    full = tokenizer.decode(alone(tiny_llama_runner, prompt, 30, set(tokenizer.eos_ids)))
    stop = full[len(full) // 2 : len(full) // 2 + 4]  # likely spans tokens: its start is held back
    assert stop.strip() and stop in full

    async def scenario():
        server = EngineAndStreams(agent_config, tokenizer)
        await server.engine.start()
        text, outputs = await collect(server.generate_answer("st", prompt, GREEDY, 30, (stop,)))
        await server.engine.stop()
        return text, outputs

    text, outputs = run(scenario())
    assert text == full[: full.index(stop)] and outputs[-1].finish_reason == "stop"


def test_queue_bound_and_prompt_bound(agent_config, tokenizer):
    config = agent_config.model_copy(
        update={"scheduler": agent_config.scheduler.model_copy(update={"max_waiting_requests": 3})}
    )

    async def scenario():
        server = EngineAndStreams(config, tokenizer)
        await server.engine.start()
        # 4 free slots + 3 waiting places.
        streams = [server.generate_answer(f"q{i}", [7], GREEDY, 3) for i in range(7)]
        with pytest.raises(AdmissionError, match="queue is full") as full:
            server.generate_answer("one-too-many", [7], GREEDY, 3)
        with pytest.raises(AdmissionError, match="64 tokens; the longest accepted is 63") as long:
            server.generate_answer("long", [7] * 64, GREEDY, 3)
        await asyncio.gather(*(collect(s) for s in streams))
        await server.engine.stop()
        with pytest.raises(AdmissionError, match="shutting down"):
            server.generate_answer("late", [7], GREEDY, 3)
        return full.value.reason, long.value.reason

    full, long = run(scenario())
    assert (full, long) == (Refusal.OVERLOADED, Refusal.TOO_LONG)
    assert [refusal_status(full), refusal_status(long), refusal_status(full, OPENAI)] == [503, 413, 429]


def test_a_dropped_stream_is_closed_on_the_event_loop_not_inside_garbage_collection(agent_config, tokenizer):
    """__del__ runs wherever garbage collection strikes, maybe in the middle of scheduler code: the
    abort it asks for must run later, on the event loop, and a closed loop must not make it raise."""
    unraisable = []

    async def scenario():
        server = EngineAndStreams(agent_config, tokenizer)
        await server.engine.start()
        stream = server.generate_answer("dropped", tokenizer.encode("The quick"), GREEDY, 60)
        inner = stream._stream  # the output layer's side of it, which the engine reports to
        del stream  # the last reference: __del__ runs here
        finished_inside_del = inner.ended
        await wait_until_async(lambda: inner.ended, 5, "the dropped stream ended on the loop")
        left_open = server.generate_answer("left", [7], GREEDY, 3)  # outlives the loop
        await server.engine.stop()
        outs = [inner.queue.get_nowait() for _ in range(inner.queue.qsize())]
        return finished_inside_del, outs[-1].finish_reason if inner.ended else None, left_open

    hook, sys.unraisablehook = sys.unraisablehook, unraisable.append
    try:
        finished_inside_del, reason, left_open = run(scenario())
        del left_open
        gc.collect()
    finally:
        sys.unraisablehook = hook
    assert not finished_inside_del and reason == FinishReason.ABORT
    assert unraisable == []


def test_a_dead_scheduler_loop_ends_every_request_refuses_new_ones_and_says_why(agent_config, tokenizer):
    async def scenario():
        server = EngineAndStreams(agent_config, tokenizer)
        engine = server.engine
        await engine.start()
        running = server.generate_answer("running", tokenizer.encode("The quick"), GREEDY, 60)
        await running.__anext__()

        def broken(busy=()):
            raise RuntimeError("a bug in the policy")

        # A bug in the pure policy cannot be caused from outside: this one is injected.
        engine.scheduler.schedule = broken
        rest = await asyncio.wait_for(collect(running), 10)
        await asyncio.wait_for(engine.dead.wait(), 1)
        reason = await engine.readiness()
        with pytest.raises(AdmissionError) as refused:
            server.generate_answer("late", [7], GREEDY, 3)
        await engine.stop()
        return rest[1][-1], engine.failure, reason, refused.value

    last, failure, reason, refused = run(scenario())
    assert last.finished and "a bug in the policy" in last.error
    assert "RuntimeError: a bug in the policy" in failure and reason == failure
    assert failure in str(refused) and refusal_status(refused.reason) == 503
