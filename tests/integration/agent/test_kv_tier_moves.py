"""Blocks' K/V out of a runner's pool into the second tier (agent/kv_tiers.py, on disk), the pool
overwritten, a new store over the same folder (a restart), and the blocks back into other pool
blocks (agent/kv_tier_moves.py): a prompt computed from them on decodes the greedy tokens of the
prompt computed whole, and the blocks read back are bit-equal to those stored. The same through
the agent's step op (StepRequest spill/restore): a spill runs before the step's chunk overwrites
the block, a restore before the chunk reads it, and a restore the tier lacks is reported."""

import numpy as np
import pytest

import runner_calls as calls
from agent.compile_cache import weights_fingerprint
from agent.contract import protocol
from agent.contract.sampling import SamplingParams
from agent.contract.step import StepChunk, StepRequest
from agent.contract.step_reply import StepReply
from agent.kv_tier_moves import export_blocks, import_blocks, open_tier_store, tier_layout
from agent.kv_tiers import KVTierStore
from agent.model.formats import load_checkpoint
from agent.runner import ModelRunner, RunnerError
from agent.service import AgentService
from config.schema import RuntimeSection

# blocks of 16, the largest bucket 32: two blocks a transfer call, so three blocks take two calls
RUNTIME = RuntimeSection(
    num_slots=4,
    max_seq_len=160,
    block_size=16,
    prefill_buckets=[16, 32],
    decode_batch_buckets=[1, 2, 4],
    attend_buckets=[160],
    compile_cache_dir=None,
)
GREEDY = SamplingParams()


@pytest.fixture(scope="module")
def module_runner(tiny_llama_dir) -> ModelRunner:
    return ModelRunner.from_checkpoint(load_checkpoint(tiny_llama_dir), RUNTIME)


@pytest.fixture
def runner(module_runner, release_all) -> ModelRunner:
    release_all(module_runner)
    return module_runner


def prompt(n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(3, 250, n).tolist()


def greedy(runner: ModelRunner, tokens, table, start: int = 0, steps: int = 8) -> list[int]:
    out = [calls.prefill(runner, 0, tokens, GREEDY, table=table, start=start)]
    for _ in range(steps):
        out += calls.decode(runner, [0])
    runner.release(0)
    return out


def test_blocks_restored_from_disk_after_a_restart_decode_as_recomputed(runner, tmp_path):
    tokens = prompt(60, seed=3)  # three full blocks and 12 positions
    home, elsewhere = list(range(0, 10)), list(range(20, 30))
    recomputed = greedy(runner, tokens, home)
    layout = tier_layout(runner)
    keys = [f"{i:032x}" for i in range(3)]
    store = KVTierStore(layout, "tiny-llama", host_bytes=0, disk_bytes=1 << 20, disk_dir=tmp_path)
    stored = export_blocks(runner, home[:3])
    for key, kv in zip(keys, stored):
        store.put(key, kv)
    store.flush()
    store.close()

    greedy(runner, prompt(60, seed=4), home)  # the pool lets the blocks go: other KV in them
    assert not np.array_equal(export_blocks(runner, home[:1])[0], stored[0])

    again = KVTierStore(layout, "tiny-llama", host_bytes=0, disk_bytes=1 << 20, disk_dir=tmp_path)
    restored = [again.get(key) for key in keys]
    assert again.counts["disk_hits"] == 3
    import_blocks(runner, elsewhere[:3], restored)
    assert all(np.array_equal(a, b) for a, b in zip(export_blocks(runner, elsewhere[:3]), stored))
    assert greedy(runner, tokens, elsewhere, start=48) == recomputed


def test_blocks_of_another_shape_or_outside_the_pool_are_refused(runner):
    kv = export_blocks(runner, [0])[0]
    with pytest.raises(RunnerError, match="block ids"):
        export_blocks(runner, [runner.num_blocks])
    with pytest.raises(RunnerError, match="not"):
        import_blocks(runner, [1], [kv[:, :, :8]])
    with pytest.raises(RunnerError, match="for 2 block ids"):
        import_blocks(runner, [1, 2], [kv])


SESSION = 5


def step(service: AgentService, request: StepRequest) -> tuple[dict, StepReply | None]:
    fields, arrays = request.to_wire()
    header, out = protocol.decode(
        service.handle(protocol.encode({"op": "step", "id": 1, "session": SESSION, **fields}, arrays))
    )
    if not header["ok"]:
        return header, None
    return header, StepReply.from_wire(header, out, request, service.runner.spec.vocab_size)


def test_a_step_spills_before_it_overwrites_and_restores_before_it_computes(runner, tmp_path):
    tokens = prompt(60, seed=7)
    home, elsewhere = list(range(0, 10)), list(range(20, 30))
    recomputed = greedy(runner, tokens, home)
    store = KVTierStore(
        tier_layout(runner), "tiny-llama", host_bytes=0, disk_bytes=1 << 20, disk_dir=tmp_path
    )
    service = AgentService(runner, model_name="tiny", rank=0, port=0, tiers=store)
    service.handle(protocol.encode({"op": "reset", "id": 0, "session": SESSION}))
    names = [f"{i:064x}" for i in range(3)]
    missing = f"{99:064x}"

    # the spill and another prompt written into the same blocks, in one step
    other = StepChunk(1, prompt(60, seed=8), home, 0, GREEDY)
    header, reply = step(service, StepRequest(chunks=[other], spill=list(zip(home[:3], names))))
    assert reply is not None and reply.restore_failed == ()
    runner.release(1)
    store.flush()
    store.close()

    # a restart: a new store over the folder, its blocks in the agent's info
    store = KVTierStore(
        tier_layout(runner), "tiny-llama", host_bytes=0, disk_bytes=1 << 20, disk_dir=tmp_path
    )
    service = AgentService(runner, model_name="tiny", rank=0, port=0, tiers=store)
    service.handle(protocol.encode({"op": "reset", "id": 0, "session": SESSION}))
    assert sorted(service.facts["kv_tier_keys"]) == names
    chunk = StepChunk(0, tokens, elsewhere, 48, GREEDY)
    restore = [*zip(names, elsewhere[:3]), (missing, 35)]
    header, reply = step(service, StepRequest(chunks=[chunk], restore=restore))
    assert reply is not None and reply.restore_failed == (missing,)
    assert reply.firsts[0] is not None and reply.firsts[0].token == recomputed[0]
    out = [reply.firsts[0].token]
    for _ in range(8):
        out += calls.decode(runner, [0])
    runner.release(0)
    assert out == recomputed
    assert store.counts["disk_hits"] == 3 and store.counts["misses"] == 1


def test_an_agent_without_the_tier_refuses_tier_moves(runner):
    service = AgentService(runner, model_name="tiny", rank=0, port=0)
    service.handle(protocol.encode({"op": "reset", "id": 0, "session": SESSION}))
    chunk = StepChunk(0, prompt(20, seed=1), [0, 1], 0, GREEDY)
    header, _ = step(service, StepRequest(chunks=[chunk], spill=[(0, f"{1:064x}")]))
    assert not header["ok"] and "keeps no KV tier" in header["error"]
    assert "kv_tier_keys" not in service.facts and 0 not in runner.slots  # refused before it ran


def test_the_store_of_a_model_has_a_folder_of_its_own(runner, tiny_llama_dir, tiny_qwen2_dir, tmp_path):
    llama = load_checkpoint(tiny_llama_dir)
    store = open_tier_store(runner, llama, 0, 1 << 20, tmp_path)
    assert store.model_identity == weights_fingerprint(llama)
    assert store.disk_dir is not None and store.disk_dir.parent == tmp_path
    qwen = open_tier_store(runner, load_checkpoint(tiny_qwen2_dir), 0, 1 << 20, tmp_path)
    assert qwen.disk_dir != store.disk_dir
    assert open_tier_store(runner, llama, 1 << 20, 0, tmp_path).disk_dir is None  # host memory only
