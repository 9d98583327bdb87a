"""The scheduler's index of the prefix cache's second tier, end to end: the engine over a real agent
process with a host and a disk tier (runtime.kv_tiers) and a pool of 8 blocks. A stream of unique
prompts pushes the first prompt's blocks out of both tiers; the agent says so with its steps and the
scheduler's index forgets them, long before its own bound (the tiers' capacity) would. The agent,
started under a umask of 0o022, creates its tier folders 0700 and its block files 0600."""

import asyncio
import os
import stat

import numpy as np

from agent.contract.sampling import SamplingParams
from agent.model.tokenizer import load_tokenizer
from agent_harness import LauncherProcess, free_ports, write_config
from config import load_config
from engine_harness import EngineAndStreams

RUNTIME = {
    "num_slots": 1,
    "max_seq_len": 128,
    "num_blocks": 8,  # a prompt of 80 takes 6: the next one evicts it (its blocks spill again)
    "prefill_buckets": [16, 64],
    "attend_buckets": [32, 128],
    "decode_batch_buckets": [1],
    "speculation": {"method": "none"},
}
# 1 MB each: 128 blocks of the tiny model (float32, 2 layers, 2 KV heads of 16, 16 positions) in host
# memory, a few less on disk (a file has its header too); the index's bound is both: 256
TIERS = {"host_mb": 1, "disk_mb": 1}
PROMPTS = 40  # 5 new full blocks each: 200 blocks, past what either tier holds, short of 256


def ids(n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(3, 250, n).tolist()


def test_the_scheduler_forgets_the_blocks_the_agents_tier_let_go(tmp_path, tiny_llama_dir):
    tiers = tmp_path / "tiers"
    path = write_config(
        tmp_path,
        tiny_llama_dir,
        free_ports(1),
        runtime={**RUNTIME, "kv_tiers": {**TIERS, "disk_dir": str(tiers)}},
        server={"agent_timeout_s": 60},
    )
    umask = os.umask(0o022)  # the agent inherits it: folders 0755, files 0644 unless it says otherwise
    try:
        launcher = LauncherProcess(path)
    finally:
        os.umask(umask)
    try:
        launcher.wait_for("all agents started", 240)
        config, tokenizer = load_config(path), load_tokenizer(tiny_llama_dir)

        async def scenario():
            server = EngineAndStreams(config, tokenizer)
            await server.engine.start()
            try:
                blocks = server.engine.scheduler.blocks[0]
                sizes, first = [], set()
                for i in range(PROMPTS):
                    answer = server.generate_answer(f"p{i}", ids(80, i), SamplingParams(), 1)
                    outputs = [o async for o in answer]
                    assert outputs[-1].finished and outputs[-1].error is None, outputs[-1]
                    if i == 0:  # its blocks, indexed as computed (the next step saves them: write-through)
                        first = set(blocks.tier_keys)
                    sizes.append(len(blocks.tier_keys))
                return blocks.tier_capacity, first, set(blocks.tier_keys), sizes
            finally:
                await server.engine.stop()

        capacity, first, indexed, sizes = asyncio.run(scenario())
    finally:
        launcher.close()

    folder = next(tiers.rglob("*.kv")).parent
    on_disk = {f.stem for f in folder.glob("*.kv")}
    assert capacity == 256 and len(first) == 5
    assert not first & on_disk  # the agent let the first prompt's blocks go, from both tiers...
    assert not first & indexed  # ...and the scheduler forgot them
    assert max(sizes) < capacity  # its own bound never came into it: the agent's reports did
    assert len(indexed) <= len(on_disk) + 128  # no more than the disk and host memory hold
    for at in (tiers, folder.parent, folder):
        assert stat.S_IMODE(at.stat().st_mode) == 0o700, at
    assert {stat.S_IMODE(f.stat().st_mode) for f in folder.glob("*.kv")} == {0o600}
