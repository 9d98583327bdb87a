"""The graphs of device_target Ascend, checked on CPU (no NPU here): the paged attention backend's
reference in MindSpore's own ops (agent/graphs/paged_attention.py) against the fused CPU kernels on
the same block tables, and the static op check of the Ascend configuration's graphs
(agent/graphs/op_check.py, tools/ascend_ops.py)."""

import asyncio
import subprocess
import sys

import numpy as np
import pytest
from conftest import TINY_RUNTIME
from mindspore import ops

import reference_numpy as ref
import runner_calls as calls
from agent.contract.sampling import SamplingParams
from agent.contract.step import StepChunk
from agent.graphs.decoder import DecoderLayer
from agent.graphs.graph_contract import check_contract
from agent.graphs.interface import bucket, mixed_rows
from agent.graphs.op_check import not_on_ascend, small_shapes, step_graph_ops
from agent.graphs.paged_attention import AscendPagedAttention
from agent.graphs.step_graphs import StepGraphs
from agent.known_answer import KnownAnswer
from agent.model.formats import load_checkpoint
from agent.model.tokenizer import load_tokenizer
from agent.runner import ModelRunner
from agent.warm_up import warm_up
from agent_harness import LauncherProcess, free_ports, write_config
from config import load_config
from config.schema import PROJECT_ROOT, RuntimeSection
from engine_harness import EngineAndStreams
from waiting import wait_until_async

PAGED = TINY_RUNTIME.model_copy(update={"decode_attention": "paged", "matmul": "mindspore"})
# Block tables of the pool's 16 blocks (4 of 16 positions each): B shares A's first two blocks and C
# A's first one (prefix-cache hits: K/V written once, through A's table, read through theirs).
TABLES = {"A": [9, 2, 14, 5], "B": [9, 2, 7, 11], "C": [9, 12, 3, 0]}


@pytest.fixture(scope="module")
def graphs(tiny_llama_dir) -> tuple[StepGraphs, StepGraphs]:
    """The fused CPU kernels (the default on CPU) and the paged backend's reference."""
    return (
        StepGraphs(load_checkpoint(tiny_llama_dir), TINY_RUNTIME),
        StepGraphs(load_checkpoint(tiny_llama_dir), PAGED),
    )


def close(fused: np.ndarray, paged: np.ndarray) -> float:
    """max |difference| relative to the logits' size."""
    return float(np.abs(fused - paged).max() / max(1.0, np.abs(fused).max()))


def test_paged_reference_follows_the_fused_kernels_through_the_same_block_tables(graphs):
    """Prompt A in chunks of 5, 11 and 29 (each chunk reads the positions before it from the cache);
    B and C start from A's cached blocks and prefill only their own tokens; A and B decode together;
    a mixed step decodes A and B beside C's chunk (16 rows, 9 of them padding); A, B and C decode in
    4 rows. Every call's logits, and then the caches, agree within float32 rounding; a K/V transfer
    from one to the other decodes alike."""
    fused, paged = graphs
    assert (
        fused.model.layers[0].kernel_layer is not None and paged.model.layers[0].paged_attention is not None
    )
    tables = {name: np.array(table, np.int32) for name, table in TABLES.items()}
    rng = np.random.default_rng(5)
    a = rng.integers(3, fused.spec.vocab_size, 45)
    b = np.concatenate([a[:32], rng.integers(3, fused.spec.vocab_size, 6)])
    c = np.concatenate([a[:16], rng.integers(3, fused.spec.vocab_size, 5)])
    diffs = []

    def prefill(table, tokens, start):
        got = [
            g.prefill(table, tokens, bucket(TINY_RUNTIME.prefill_buckets, len(tokens)), start) for g in graphs
        ]
        diffs.append(close(*(logits.asnumpy()[0] for logits in got)))
        return int(np.argmax(got[0].asnumpy()[0]))

    for start, end in [(0, 5), (5, 16), (16, 45)]:
        next_a = prefill(tables["A"], a[start:end], start)
    next_b = prefill(tables["B"], b[32:], 32)
    tokens, positions = [next_a, next_b], [45, 38]
    for _ in range(4):
        got = [
            g.decode(np.stack([tables["A"], tables["B"]]), np.array(tokens), np.array(positions), 2)[0]
            for g in graphs
        ]
        diffs.append(close(*(logits.asnumpy() for logits in got)))
        tokens = np.argmax(got[0].asnumpy(), -1).tolist()
        positions = [p + 1 for p in positions]
    chunk = StepChunk(slot=2, tokens=c.tolist(), table=tables["C"], start=16, sampling=SamplingParams())
    rows = mixed_rows(TINY_RUNTIME)
    step = np.stack([tables["A"], tables["B"]]), np.array(tokens), np.array(positions), [chunk], rows, 3
    got = [g.mixed(*step)[0].asnumpy() for g in graphs]
    diffs.append(close(*got))
    tokens = np.argmax(got[0], -1).tolist()
    three = np.stack([tables["A"], tables["B"], tables["C"]])
    got = [
        g.decode(three, np.array(tokens), np.array([positions[0] + 1, positions[1] + 1, 21]), 4)[0]
        for g in graphs
    ]
    diffs.append(close(*(logits.asnumpy()[:3] for logits in got)))
    assert max(diffs) < 1e-4, diffs
    assert len(diffs) == 10

    # The paged cache holds [num_blocks, block_size, KV heads, head_dim] (ReshapeAndCache's layout);
    # the CPU kernels' rows (block * KV + head) * block_size + offset hold the same values.
    pool = fused.inputs.pool
    for layer_f, layer_p in zip(fused.model.layers, paged.model.layers):
        for kind in ("k_cache", "v_cache"):
            cpu = getattr(layer_f, kind).asnumpy()
            blocks = cpu.reshape(-1, fused.inputs.kv_heads, TINY_RUNTIME.block_size, fused.spec.head_dim)
            upstream = getattr(layer_p, kind).asnumpy()
            assert upstream.shape == (
                len(blocks),
                TINY_RUNTIME.block_size,
                fused.inputs.kv_heads,
                fused.spec.head_dim,
            )
            assert np.abs(upstream[:pool] - blocks.transpose(0, 2, 1, 3)[:pool]).max() < 1e-5

    # PD disaggregation across the two: A's 51 cached positions exported by the CPU kernels' graphs
    # equal the paged ones'; imported into free blocks of the paged cache, they decode as A does.
    sent = fused.kv_export(tables["A"], 51)
    assert np.abs(paged.kv_export(tables["A"], 51) - sent).max() < 1e-5
    free = np.array([1, 4, 6, 8], np.int32)
    paged.kv_import(free, sent)
    want = fused.decode(tables["A"][None], np.array([7]), np.array([51]), 1)[0].asnumpy()
    got = paged.decode(free[None], np.array([7]), np.array([51]), 1)[0].asnumpy()
    assert close(want, got) < 1e-4


def test_a_runner_over_the_paged_backend_chunks_prompts_and_reuses_prefixes(graphs, tiny_llama_dir):
    """What the agent tells the server: chunked prefill, prefix caching and mixed steps, prompts up to
    max_seq_len - 1 (the gather path: the largest prefill bucket, no prefix caching); and an agent's
    warm-up in each role passes its known-answer checks (the probe in the scratch blocks, beside the
    padding rows of the mixed steps; the K/V transfers against the numpy forward's K/V)."""
    runner = ModelRunner(graphs[1], PAGED)
    assert runner.chunked_prefill and runner.prefix_caching
    assert runner.mixed_rows == mixed_rows(PAGED) > 0
    assert runner.max_prompt_len == PAGED.max_seq_len - 1
    known = KnownAnswer.of_checkpoint(load_checkpoint(tiny_llama_dir), PAGED)
    for role in ("mixed", "prefill", "decode"):
        warm_up(runner, lambda message: None, role, known)


ASCEND_CONFIGS = sorted(
    path.relative_to(PROJECT_ROOT).as_posix()
    for path in (PROJECT_ROOT / "config").glob("*.yaml")
    if load_config(path).runtime.device_target == "Ascend"
)


@pytest.mark.parametrize("config", ASCEND_CONFIGS)
def test_each_shipped_ascend_configuration_keeps_the_kernels_contract(config):
    """python -m tools.ascend_ops over each shipped Ascend configuration, at its model's attention
    shapes (head_dim 128): the contract it prints (the context, the phases, every input's name and
    the operands it feeds), no problem, ReshapeAndCache in every step graph, FlashAttentionScore for
    prompts and PagedAttention for the rest, and nothing MindSpore lacks on Ascend."""
    command = [sys.executable, "-m", "tools.ascend_ops", "--config", config]
    done = subprocess.run(command, cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    assert "head_dim 128" in out.splitlines()[0]
    context = "context: jit_config {'jit_level': 'O0', 'infer_boost': 'on'}"
    assert f"{context}; phases prefill prefill, increment increment" in out
    assert "increment: batch_valid_length INT32[?] -> PagedAttention.context_lens x2" in out
    assert "increment: q_seq_lens INT32[?] -> PagedAttention.q_seq_lens x2" in out
    assert "prefill: q_seq_lens INT32[?] -> FlashAttentionScore.actual_seq_qlen x2" in out
    assert "prefill: batch_valid_length INT32[?] -> FlashAttentionScore.actual_seq_kvlen x2" in out
    assert "problem:" not in out and out.rstrip().endswith("contract: passed")
    listed = [line.split(": ", 1) for line in out.splitlines()[1:] if "->" not in line]
    ops = {name: set(rest.split()) for name, rest in listed}
    assert {"ReshapeAndCache", "FlashAttentionScore"} <= ops["prefill"] and "PagedAttention" not in ops[
        "prefill"
    ]
    for graph in ("decode", "mixed"):
        assert {"ReshapeAndCache", "PagedAttention"} <= ops[graph] and "FlashAttentionScore" not in ops[graph]
    assert not {"Softmax", "BatchMatMul", "ScatterUpdate", "Custom"} & ops["all"]
    assert ops["not on Ascend"] == {"none"}


def test_the_cpu_configuration_fails_the_ascend_op_check(graphs):
    """The CPU configuration's graphs, with the custom kernels, are refused by the same op check."""
    cpu = step_graph_ops(graphs[0], TINY_RUNTIME)
    assert not_on_ascend(cpu["prefill"]) == not_on_ascend(cpu["decode"]) == ["Custom"]


def test_the_contract_check_finds_each_departure_from_the_upstream_contract(tiny_llama_dir, monkeypatch):
    """The check passes the Ascend configuration's graphs as built (over the tiny model, traced on
    CPU), and names each departure made to them (methods replaced on the real cells before they are
    built and traced): the read not ordered after the write, a length fed to the wrong operand, a
    graph outside the predict phase, the context without infer_boost."""
    runtime = small_shapes(load_config(PROJECT_ROOT / "config" / "qwen3_8b_ascend.yaml").runtime)

    def problems() -> list[str]:
        return check_contract(StepGraphs(load_checkpoint(tiny_llama_dir), runtime), runtime).problems

    assert problems() == []

    def unordered(self, x, cos, sin, rot, paging, k_cache, v_cache, prompt):
        slot_mapping, batch_valid_length, q_seq_lens, block_tables, attn_mask = paging
        q, k, v = self.qkv(x, cos, sin, rot)
        self.paged_attention.write(k, v, k_cache, v_cache, slot_mapping)
        if prompt:
            out = self.paged_attention.prompt(q, k, v, batch_valid_length, q_seq_lens, attn_mask)
        else:
            out = self.paged_attention.attend(
                q, k_cache, v_cache, block_tables, batch_valid_length, q_seq_lens, attn_mask
            )
        return self.feed_forward(self.add_projected(x, out, self.wo, self.hidden), slot_mapping)

    with monkeypatch.context() as patch:
        patch.setattr(DecoderLayer, "paged", unordered)
        found = problems()
    assert "prefill: a FlashAttentionScore's query is not ordered after its layer's write" in found
    assert "increment: a PagedAttention's query is not ordered after its layer's write" in found

    def swapped(self, query, key_cache, value_cache, block_tables, batch_valid_length, q_seq_lens, attn_mask):
        query = ops.reshape(query, (-1, self.heads * self.head_dim))
        return self.paged_attention(
            query, key_cache, value_cache, block_tables, q_seq_lens, None, None, attn_mask, batch_valid_length
        )

    with monkeypatch.context() as patch:
        patch.setattr(AscendPagedAttention, "attend", swapped)
        found = problems()
    context = (
        "increment: PagedAttention.context_lens comes from q_seq_lens, upstream's from batch_valid_length"
    )
    assert context in found
    query = "increment: PagedAttention.q_seq_lens comes from batch_valid_length, upstream's from q_seq_lens"
    assert query in found

    graphs = StepGraphs(load_checkpoint(tiny_llama_dir), runtime)
    graphs.decode_graph.phase = "predict"
    found = check_contract(graphs, runtime).problems
    assert found == ["the increment graph runs in phase 'predict', not 'increment'"]
    monkeypatch.setattr(RuntimeSection, "jit_config", property(lambda self: {"jit_level": "O0"}))
    assert problems() == [
        "jit_config {'jit_level': 'O0'}: the internal kernels need jit_level O0 and infer_boost on "
        "(device_target Ascend, decode_attention paged)"
    ]


def test_float16_paged_graphs_follow_the_reference(tiny_llama_dir):
    """The Ascend configuration's dtype and attention (float16, paged) on CPU, the reference backend in
    place of the kernels: a prompt in two chunks, then greedy decode steps, give the fp64 reference's
    tokens."""
    runtime = PAGED.model_copy(update={"dtype": "float16"})
    runner = ModelRunner.from_checkpoint(load_checkpoint(tiny_llama_dir), runtime)
    prompt = load_tokenizer(tiny_llama_dir).encode("The capital of France is Paris.")
    table = runner.graphs.inputs.slot_table(1)
    calls.prefill_chunk(runner, 1, prompt[:5], table)
    tokens = [calls.prefill(runner, 1, prompt, SamplingParams(), table, start=5)]
    tokens += [calls.decode(runner, [1])[0] for _ in range(8)]
    assert tokens == ref.greedy(ref.load_hf_reference(tiny_llama_dir), prompt, 9)


def test_an_agent_on_the_paged_backend_serves_chunked_prompts_and_prefix_hits(tmp_path, tiny_llama_dir):
    """A real agent process with decode_attention paged (the Ascend choice, its reference on CPU) under
    the engine: a 150-token prompt in chunks of at most 40 positions (the gather path would refuse it:
    longer than its largest prefill bucket) gives the numpy reference's greedy tokens, and a second
    prompt with the same 128-token prefix finds its 8 full blocks cached and answers as the first."""
    runtime = {
        "num_slots": 4,
        "max_seq_len": 256,
        "prefill_buckets": [16, 64],
        "decode_batch_buckets": [1, 2, 4],
        "attend_buckets": [256],  # unread by the paged backend, checked all the same
        "decode_attention": "paged",
        "matmul": "mindspore",
    }
    scheduler = {"max_num_batched_tokens": 40}
    path = write_config(tmp_path, tiny_llama_dir, free_ports(1), runtime=runtime, scheduler=scheduler)
    tokenizer = load_tokenizer(tiny_llama_dir)
    prompt = np.random.default_rng(8).integers(3, 250, 150).tolist()
    other = prompt[:128] + [5, 6, 7]

    async def scenario():
        server = EngineAndStreams(load_config(path), tokenizer)
        await server.engine.start()
        try:
            answers = []
            for request_id, tokens in (("first", prompt), ("second", other)):
                outputs = [o async for o in server.generate_answer(request_id, tokens, SamplingParams(), 8)]
                assert outputs[-1].finished and outputs[-1].error is None, outputs[-1]
                answers.append([o.token_id for o in outputs if o.token_id is not None])
            metric = server.engine.metrics.registry.get_sample_value
            # the loop's next iteration counts them into the metrics
            await wait_until_async(
                lambda: metric("llm_serving_prefix_cache_hits_total"), 5, "a prefix cache hit"
            )
            return answers, metric("llm_serving_prefix_cache_hits_total")
        finally:
            await server.engine.stop()

    launcher = LauncherProcess(path)
    try:
        launcher.wait_for("all agents started", 240)
        (first, second), hits = asyncio.run(scenario())
    finally:
        launcher.close()
    reference = ref.load_hf_reference(tiny_llama_dir)
    assert first == ref.greedy(reference, prompt, 8, tokenizer.eos_ids)
    assert second == ref.greedy(reference, other, 8, tokenizer.eos_ids)
    assert hits == 128
