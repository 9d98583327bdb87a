"""The paged engine end to end: the engine and its answer streams (OutputProcessor) over a real
agent process whose KV pool is far smaller than its slots' whole lengths. A prompt many chunks long gives
the greedy tokens of the independent numpy reference; a prefix-cache hit gives the tokens of a cold
prefill; 16 concurrent streams in a pool that holds a third of them are preempted and resumed, and
every answer equals its answer alone."""

import asyncio

import numpy as np
import pytest

import reference_numpy as ref
from agent.contract.sampling import SamplingParams
from agent.model.tokenizer import load_tokenizer
from agent_harness import LauncherProcess, free_ports, write_config
from config import load_config
from engine_harness import EngineAndStreams
from waiting import wait_until_async

GREEDY = SamplingParams()
SEEDED = SamplingParams(do_sample=True, top_k=20, temperature=0.9, seed=3)
PAGED = {
    "num_slots": 16,
    "max_seq_len": 512,
    "num_blocks": 40,  # 640 positions: one long sequence, or a third of 16 short ones at their longest
    "block_size": 16,
    "prefill_buckets": [16, 64],
    "decode_batch_buckets": [1, 2, 4, 8, 16],
    "attend_buckets": [512],
    "compile_cache_dir": None,
    # one token an output: tokens_of reads each output's token_id (a verified step's come as one)
    "speculation": {"method": "none"},
}


@pytest.fixture(scope="module")
def config(tmp_path_factory, tiny_llama_dir):
    directory = tmp_path_factory.mktemp("paged")
    # a small token budget: chunks end anywhere, not on bucket or block boundaries
    scheduler = {"max_num_batched_tokens": 40, "max_waiting_requests": 32}
    server = {"agent_timeout_s": 30}
    path = write_config(
        directory, tiny_llama_dir, free_ports(1), runtime=PAGED, server=server, scheduler=scheduler
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


async def tokens_of(server: EngineAndStreams, request_id: str, prompt, params, n: int) -> list[int]:
    outputs = [o async for o in server.generate_answer(request_id, prompt, params, n)]
    assert outputs[-1].finished and outputs[-1].error is None, outputs[-1]
    return [o.token_id for o in outputs if o.token_id is not None]


def serve(config, tokenizer, scenario):
    async def run():
        server = EngineAndStreams(config, tokenizer)
        await server.engine.start()
        try:
            return await scenario(server)
        finally:
            await server.engine.stop()

    return asyncio.run(run())


def ids(n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(3, 250, n).tolist()


def test_a_prompt_of_many_chunks_gives_the_reference_tokens(config, tokenizer, tiny_llama_dir):
    prompt = ids(300, seed=1)  # 5 buckets of 64, in chunks of at most 40 positions a step

    async def scenario(server):
        return await tokens_of(server, "long", prompt, GREEDY, 8)

    got = serve(config, tokenizer, scenario)
    assert got == ref.greedy(ref.load_hf_reference(tiny_llama_dir), prompt, 8, tokenizer.eos_ids)


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_a_prefix_cache_hit_gives_the_tokens_of_a_cold_prefill(config, tokenizer, params):
    system = ids(100, seed=2)  # 6 full blocks of 16 shared
    first, second = system + ids(9, seed=3), system + ids(9, seed=3)

    async def scenario(server):
        cold = await tokens_of(server, "cold", first, params, 12)
        warm = await tokens_of(server, "warm", second, params, 12)
        metric = server.engine.metrics.registry.get_sample_value
        # the loop's next iteration counts them into the metrics
        await wait_until_async(
            lambda: metric("llm_serving_prefix_cache_queries_total") == 2 * 109,
            5,
            "both prompts' queries counted",
        )
        counts = [metric(f"llm_serving_prefix_cache_{kind}_total") for kind in ("queries", "hits")]
        cached = metric("llm_serving_kv_blocks", {"state": "cached"})
        return cold, warm, counts, cached

    cold, warm, (queried, hit), cached = serve(config, tokenizer, scenario)
    # the second found the first's full blocks: 6 of the system prompt's, none of the 9 after it
    assert warm == cold and queried == 2 * 109 and hit == 96 and cached >= 6


def test_sixteen_streams_in_a_third_of_their_blocks_are_preempted_and_lose_nothing(config, tokenizer):
    prompts = [ids(20 + i, seed=10 + i) for i in range(16)]
    params = [GREEDY if i % 2 else SEEDED for i in range(16)]
    n = 40  # 20..35 + 40 positions: 4 blocks each, 64 in all, the pool holds 40

    async def alone(server):
        return [await tokens_of(server, f"alone{i}", p, params[i], n) for i, p in enumerate(prompts)]

    async def together(server):
        answers = await asyncio.gather(
            *(tokens_of(server, f"together{i}", p, params[i], n) for i, p in enumerate(prompts))
        )
        return (
            answers,
            server.engine.scheduler.preemptions,
            server.engine.stats().kv_blocks("used"),
            mixed_steps(server),
        )

    want = serve(config, tokenizer, alone)
    got, preemptions, used_after, mixed = serve(config, tokenizer, together)
    assert preemptions > 0 and used_after == 0
    assert mixed > 0  # decodes and prompt chunks (admissions, recomputes) ran as one call
    assert got == want


def mixed_steps(server: EngineAndStreams) -> float:
    """Agent calls that ran a decode and prompt chunks together (the agent_step histogram's count)."""
    return sum(
        sample.value
        for metric in server.engine.metrics.registry.collect()
        for sample in metric.samples
        if sample.name.endswith("agent_step_seconds_count") and sample.labels.get("op") == "mixed"
    )
