"""Memory planning (agent/memory_plan.py) and half precision: sizes from the model's spec, slots and
lengths from a budget, clear refusals, and a float16 runner against the numpy reference."""

import numpy as np
import pytest
from conftest import TINY_RUNTIME

import reference_numpy as ref
import runner_calls as calls
from agent.contract.sampling import SamplingParams
from agent.memory_plan import MB, MemoryPlanError, check_peak, plan_memory, rank_spec
from agent.model.formats import load_checkpoint
from agent.model.tokenizer import load_tokenizer
from agent.runner import ModelRunner
from config.schema import RuntimeSection

BUDGETED = dict(
    prefill_buckets=[32, 64],
    decode_batch_buckets=[1, 4, 8, 16],
    attend_buckets=[256, 512, 2048],
    compile_cache_dir=None,
)


def test_plan_sizes_come_from_the_spec(default_model_path):
    spec = load_checkpoint(default_model_path).spec
    runtime = RuntimeSection(num_slots=8, max_seq_len=2048, **BUDGETED)
    resolved, plan = plan_memory(spec, runtime)
    # without a budget, each slot gets its whole length: 8 x 2048 / 16 blocks
    assert (resolved.num_slots, resolved.max_seq_len, resolved.num_blocks, plan.budget_mb) == (
        8,
        2048,
        1024,
        None,
    )
    # SmolLM2-135M: 30 layers x 2 x 3 KV heads x 64 x 4 bytes = 46080 bytes per position.
    assert plan.block_mb == pytest.approx(46080 * 16 / MB)
    assert plan.kv_mb == pytest.approx((1024 + 64 // 16) * 46080 * 16 / MB)  # + the scratch blocks
    # from the spec alone: 134.5M fp32 parameters
    assert plan.weights_mb == pytest.approx(spec.parameter_count() * 4 / MB)
    assert (
        "memory plan: weights 513 MB, KV cache 723 MB: 1024 blocks of 16 positions (16384 positions, "
        "8.0 sequences of max_seq_len 2048) shared by 8 slots"
    ) in plan.describe()


def test_a_budget_fills_the_pool_and_auto_seats_are_the_largest_batch(default_model_path):
    spec = load_checkpoint(default_model_path).spec
    runtime = RuntimeSection(num_slots="auto", max_seq_len=2048, memory_budget_mb=1500, **BUDGETED)
    resolved, plan = plan_memory(spec, runtime)
    assert resolved.num_slots == plan.num_slots == 16  # a decode step never runs more rows
    assert resolved.num_blocks == plan.num_blocks and plan.num_blocks * 16 > 2048
    assert plan.total_mb <= 1500 < plan.total_mb + plan.block_mb
    # fewer blocks than the slots' whole lengths: they share the pool
    assert plan.num_blocks < 16 * 2048 // 16
    given = plan_memory(spec, runtime.model_copy(update={"num_blocks": 300}))[1]
    assert given.num_blocks == 300 and given.total_mb < plan.total_mb


def test_a_q8_0_cache_plans_34_bytes_for_32_values_and_holds_more_positions(default_model_path):
    """runtime.kv_cache_dtype q8_0: a position of SmolLM2-135M takes 30 layers x 2 x 3 KV heads x 2
    blocks x 34 bytes = 12240 bytes against float32's 46080, so one budget holds ~3.7x the blocks
    (the issue's target: twice the positions)."""
    spec = load_checkpoint(default_model_path).spec
    runtime = RuntimeSection(num_slots=16, max_seq_len=2048, memory_budget_mb=1500, **BUDGETED)
    _, plain = plan_memory(spec, runtime)
    _, q8 = plan_memory(spec, runtime.model_copy(update={"kv_cache_dtype": "q8_0"}))
    assert q8.block_mb == pytest.approx(12240 * 16 / MB)
    assert q8.num_blocks >= 2 * plain.num_blocks and q8.num_blocks > 3.7 * plain.num_blocks
    assert q8.total_mb <= 1500 < q8.total_mb + q8.block_mb
    assert " MB (q8_0): " in q8.describe() and "(q8_0)" not in plain.describe()


def test_a_budget_with_a_given_length_keeps_the_default_buckets_up_to_it(default_model_path):
    """max_seq_len 1024 with a budget and nothing else: the plan's runtime takes the default buckets
    cut at 1024 (it once validated the unplanned defaults, [256, 512, 2048], and stopped the agent)."""
    spec = load_checkpoint(default_model_path).spec
    runtime = RuntimeSection(num_slots=16, max_seq_len=1024, memory_budget_mb=1500, compile_cache_dir=None)
    resolved = plan_memory(spec, runtime)[0]
    assert (resolved.attend_buckets, resolved.prefill_buckets) == ([256, 512, 1024], [32, 64, 128, 512])
    assert resolved.max_seq_len == 1024 and resolved.num_blocks * 16 >= 1024


def test_auto_length_is_the_context_shortened_to_the_budget(default_model_path):
    spec = load_checkpoint(default_model_path).spec  # trained context 8192
    roomy = RuntimeSection(num_slots=4, max_seq_len="auto", memory_budget_mb=100_000, **BUDGETED)
    assert plan_memory(spec, roomy)[0].max_seq_len == spec.max_context == 8192
    tight = roomy.model_copy(update={"memory_budget_mb": 800})
    resolved, plan = plan_memory(spec, tight)
    assert resolved.max_seq_len % 256 == 0 and 512 <= resolved.max_seq_len < 8192
    assert resolved.attend_buckets[-1] == resolved.max_seq_len
    assert plan.total_mb <= 800 and resolved.num_blocks * 16 >= resolved.max_seq_len


def test_the_default_plan_holds_the_context_and_64_short_chats_at_once(default_model_path):
    from config import load_config

    runtime = load_config().runtime
    resolved, plan = plan_memory(load_checkpoint(default_model_path).spec, runtime)
    assert resolved.max_seq_len == 8192 and resolved.num_slots == 64
    assert plan.num_blocks >= 64 * -(-300 // 16)  # 64 chats of ~300 tokens with their answers
    assert plan.total_mb <= runtime.memory_budget_mb


def test_the_cpu_plan_has_no_reserves_whatever_the_ranks(default_model_path):
    """The device reserves (kernel workspace, graph inputs/outputs, HCCL buffers) are Ascend's and
    GPU's: the CPU plan is what it was, one line, a tensor-parallel group's included."""
    spec = load_checkpoint(default_model_path).spec
    runtime = RuntimeSection(num_slots=16, max_seq_len=2048, memory_budget_mb=1500, **BUDGETED)
    resolved, plan = plan_memory(spec, runtime)
    assert plan.reserves == () and plan.pooled_mb == plan.total_mb
    assert plan.total_mb == plan.weights_mb + plan.kv_mb + plan.working_mb
    assert plan_memory(spec, runtime, ranks=2) == (resolved, plan)
    assert "\n" not in plan.describe() and "reserves" not in plan.describe()


def test_budgets_too_small_are_refused_with_the_sizes(default_model_path):
    spec = load_checkpoint(default_model_path).spec
    with pytest.raises(MemoryPlanError, match=r"does not hold the weights \(513 MB\)"):
        plan_memory(spec, RuntimeSection(num_slots="auto", memory_budget_mb=500, **BUDGETED))
    with pytest.raises(MemoryPlanError, match="num_blocks 2048 of 16 positions: .* holds at most"):
        plan_memory(spec, RuntimeSection(num_blocks=2048, memory_budget_mb=1000, **BUDGETED))
    with pytest.raises(MemoryPlanError, match="at least 128 blocks"):
        plan_memory(spec, RuntimeSection(max_seq_len=2048, memory_budget_mb=600, **BUDGETED))
    with pytest.raises(ValueError, match="num_blocks 100 of 16 positions do not hold one sequence"):
        RuntimeSection(num_blocks=100, **BUDGETED)
    with pytest.raises(ValueError, match="auto need memory_budget_mb"):
        RuntimeSection(num_slots="auto")


def test_float16_is_half_the_memory():
    runtime = RuntimeSection(dtype="float16", matmul="mindspore", decode_attention="gather")
    with pytest.raises(ValueError, match="float16 on CPU needs matmul: mindspore"):
        RuntimeSection(dtype="float16")
    with pytest.raises(ValueError, match="bfloat16 has no MindSpore CPU kernels"):
        RuntimeSection(dtype="bfloat16", matmul="mindspore", decode_attention="gather")
    assert runtime.dtype == "float16"


def test_float16_runner_follows_the_reference(tiny_llama_dir):
    """The half-precision graphs (what Ascend runs) on CPU: logits within fp16 rounding of the fp64
    reference, the same greedy tokens, and a KV cache of half the bytes."""
    runtime = TINY_RUNTIME.model_copy(
        update={"dtype": "float16", "matmul": "mindspore", "decode_attention": "gather"}
    )
    checkpoint = load_checkpoint(tiny_llama_dir)
    half = ModelRunner.from_checkpoint(checkpoint, runtime)
    gather = TINY_RUNTIME.model_copy(update={"decode_attention": "gather"})
    full = ModelRunner.from_checkpoint(checkpoint, gather)
    assert half.graphs.cache_bytes() * 2 == full.graphs.cache_bytes()
    prompt = load_tokenizer(tiny_llama_dir).encode("The capital of France is Paris.")
    reference = ref.load_hf_reference(tiny_llama_dir)
    got = half.graphs.prefill(half.graphs.inputs.slot_table(0), np.asarray(prompt), 64).asnumpy()[0]
    want = ref.forward(reference, prompt, ref.RefCache())[-1]
    assert got.dtype == np.float32
    assert np.abs(got - want).max() < 0.02 * np.abs(want).max()
    tokens = [calls.prefill(half, 1, prompt, SamplingParams())] + [
        calls.decode(half, [1])[0] for _ in range(8)
    ]
    assert tokens == ref.greedy(reference, prompt, 9)


def llama2(layers: int, hidden: int, heads: int, kv_heads: int, ffn: int):
    """Llama 2's published sizes (7B: 32, 4096, 32, 32, 11008; 70B: 80, 8192, 64, 8, 28672)."""
    from agent.model.spec import ModelSpec

    return ModelSpec(
        architecture="llama",
        name=f"Llama-2-{layers}L",
        num_layers=layers,
        hidden_size=hidden,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=128,
        intermediate_size=ffn,
        vocab_size=32000,
        rope_theta=10000.0,
        rms_eps=1e-5,
        tied_embeddings=False,
        qkv_bias=False,
        max_context=4096,
        bos_id=1,
        eos_ids=(2,),
    )


def ascend_example_runtime() -> RuntimeSection:
    from config import load_config
    from config.schema import PROJECT_ROOT

    config = load_config(PROJECT_ROOT / "config" / "llama2_7b_ascend.yaml")
    assert (config.runtime.device_target, config.runtime.dtype) == ("Ascend", "float16")
    assert config.runtime.memory_budget_mb <= config.agents.device_memory_mb == 65536  # a 64 GB 910B
    return config.runtime


def test_shipped_ascend_example_plans_llama2_7b_into_a_64gb_910b():
    """config/llama2_7b_ascend.yaml with Llama-2-7B's published sizes (no NPU here to run it)."""
    resolved, plan = plan_memory(llama2(32, 4096, 32, 32, 11008), ascend_example_runtime())
    assert plan.weights_mb == pytest.approx(6738.4e6 * 2 / MB, rel=1e-3)  # 6.74B parameters
    assert plan.block_mb == 8  # 32 layers x 2 x 4096 x 2 bytes x 16 positions
    # working, the prompt path: one layer's activations of 512 rows (4 x 4096 + 4 x 4096 + 3 x 11008
    # values of 2 bytes: 64 MB) and the RoPE tables; the Ascend kernels keep the scores on chip and
    # read the blocks in place (the gather path adds every layer's prefill scores, 32 x 32 heads x
    # 512^2 x 4 bytes, and one layer's K and V for 32 rows over 2048 positions: 1024 MB each)
    assert plan.working_mb == pytest.approx(64 + 2, abs=1)
    # 32 slots (the largest decode batch), blocks for about 41.6 sequences of 2048 positions after the
    # reserves (test_ascend_reserves_are_lines_of_the_plan_and_the_pool_gets_what_they_leave)
    assert resolved.num_slots == 32 and resolved.num_blocks == 5322 and plan.total_mb <= 58000
    gather = ascend_example_runtime().model_copy(update={"decode_attention": "gather"})
    assert plan_memory(llama2(32, 4096, 32, 32, 11008), gather)[1].working_mb == pytest.approx(2114, abs=1)


def test_ascend_reserves_are_lines_of_the_plan_and_the_pool_gets_what_they_leave():
    """On Ascend the plan sets aside the kernel workspace (a stated margin: 1 GB + 2% of the budget)
    and the graphs' inputs and outputs (measured: the largest step's outputs are a 512-row prefill's
    logits of every row, float32), each a line of the plan, and the KV pool takes what is left: 160
    blocks of 8 MB fewer than the 5482 planned before them (their 2248 MB, less the 968 MB of working
    memory the prefill scores took, which the Ascend kernels keep on chip)."""
    resolved, plan = plan_memory(llama2(32, 4096, 32, 32, 11008), ascend_example_runtime())
    reserves = {reserve.name: reserve for reserve in plan.reserves}
    assert list(reserves) == ["kernel workspace", "graph inputs/outputs"]  # one rank: no HCCL buffers
    assert reserves["kernel workspace"].mb == pytest.approx(1024 + 0.02 * 58000)
    outputs = 512 * 32000 * 4 / MB
    assert outputs < reserves["graph inputs/outputs"].mb < outputs + 4  # the inputs: block tables, ids
    assert all(reserve.pooled for reserve in plan.reserves) and plan.pooled_mb == plan.total_mb
    left = 58000 - plan.weights_mb - plan.working_mb - plan.reserves_mb
    assert resolved.num_blocks == pytest.approx(left // plan.block_mb - plan.scratch_blocks, abs=1)
    assert 5482 - resolved.num_blocks == pytest.approx((plan.reserves_mb + plan.working_mb - 1034) / 8, abs=1)
    assert plan.total_mb <= 58000 < plan.total_mb + plan.block_mb
    lines = plan.describe().splitlines()
    assert f"reserves {plan.reserves_mb:.0f} MB: {plan.total_mb:.0f} MB of a 58000 MB budget" in lines[0]
    assert [line.split(":")[0] for line in lines[1:]] == [
        "  working",
        "  kernel workspace",
        "  graph inputs/outputs",
    ]
    assert "logits [512, 32000] float32" in lines[3] and "the prompt path" in lines[1]


def test_a_block_table_of_every_decode_row_is_a_graph_input():
    """The graph inputs are measured on what GraphInputs builds: the decode graph of 32 rows takes
    their block tables [32, 2048 / 16] int32, among ids and positions of a few bytes a row."""
    from agent.memory_plan import graph_input_bytes

    runtime = ascend_example_runtime()
    sizes = graph_input_bytes(llama2(32, 4096, 32, 32, 11008), runtime, 32)
    # prefill and its every-row variant per bucket, decode per batch bucket, mixed per batch bucket
    assert len(sizes) == 2 * 2 + 5 + 5
    decode_32 = sizes[4 + 4]
    assert 32 * 128 * 4 <= decode_32 < 32 * 128 * 4 + 32 * 64


def test_hccl_buffers_are_reserved_for_a_tensor_parallel_group_on_ascend_only(monkeypatch):
    """Each communicator holds 2 x HCCL_BUFFSIZE (CANN's default 200 MB), outside MindSpore's pool:
    400 MB, 50 blocks of 8 MB, of a rank of 2; none for one rank, none on GPU (NCCL, not planned)."""
    monkeypatch.delenv("HCCL_BUFFSIZE", raising=False)
    spec, runtime = rank_spec(llama2(32, 4096, 32, 32, 11008), 2), ascend_example_runtime()
    one, two = plan_memory(spec, runtime)[1], plan_memory(spec, runtime, ranks=2)[1]
    assert "HCCL" not in one.describe()
    hccl = {reserve.name: reserve for reserve in two.reserves}["HCCL buffers"]
    assert hccl.mb == 400 and not hccl.pooled and two.pooled_mb == pytest.approx(two.total_mb - 400)
    assert one.num_blocks - two.num_blocks == 400 // 4  # a rank's block: 4 MB (half the KV heads)
    assert "  HCCL buffers: 400 MB (1 communicator x 2 x HCCL_BUFFSIZE 200 MB" in two.describe()
    monkeypatch.setenv("HCCL_BUFFSIZE", "100")
    assert plan_memory(spec, runtime, ranks=2)[1].reserves[-1].mb == 200
    monkeypatch.setenv("HCCL_BUFFSIZE", "lots")
    with pytest.raises(MemoryPlanError, match="HCCL_BUFFSIZE='lots' is not a whole number"):
        plan_memory(spec, runtime, ranks=2)
    gpu = runtime.model_copy(update={"device_target": "GPU", "decode_attention": "auto"})
    names = [reserve.name for reserve in plan_memory(spec, gpu, ranks=2)[1].reserves]
    assert names == ["kernel workspace", "graph inputs/outputs"]


def test_a_budget_too_small_for_the_reserves_is_refused_naming_them():
    runtime = ascend_example_runtime().model_copy(update={"memory_budget_mb": 14000})
    with pytest.raises(MemoryPlanError, match=r"the reserves \(\d+ MB: kernel workspace 1304 MB, graph"):
        plan_memory(llama2(32, 4096, 32, 32, 11008), runtime)


def test_check_peak_refuses_a_warm_up_over_the_plan_with_the_numbers():
    """After warm-up, MindSpore's pool's peak (max_memory_allocated) is held to what the plan gives
    the pool (the plan less HCCL's buffers, which HCCL allocates outside it)."""
    spec, runtime = rank_spec(llama2(32, 4096, 32, 32, 11008), 2), ascend_example_runtime()
    plan = plan_memory(spec, runtime, ranks=2)[1]
    assert check_peak(plan, int(plan.pooled_mb * MB)) is None
    assert check_peak(plan, 30000 * MB, 58000 * MB) is None  # reserved is named, never held to the plan
    refusal = check_peak(plan, int((plan.pooled_mb + 100) * MB), 58000 * MB)
    assert refusal is not None
    assert f"peaked at {plan.pooled_mb + 100:.0f} MB allocated (58000 MB reserved)" in refusal
    assert f"100 MB over the {plan.pooled_mb:.0f} MB the memory plan gives it" in refusal
    assert f"weights {plan.weights_mb:.0f} MB, KV cache {plan.kv_mb:.0f} MB" in refusal
    assert "kernel workspace 2184 MB" in refusal and "400 MB of HCCL buffers outside the pool" in refusal
    assert f"runtime.num_blocks to at most {plan.num_blocks - 25}" in refusal  # 100 MB of 4 MB blocks


def test_a_tensor_parallel_rank_plans_its_share_llama2_70b_on_eight_910b():
    """Llama-2-70B at TP 8 with the Ascend example's runtime: each rank holds 1 of the 8 KV heads,
    8 query heads and 1/8 of the FFN, the embedding and output head whole: ~17 GB of float16
    weights, where the whole model (131 GB) does not fit a 64 GB card at all."""
    from agent.memory_plan import weights_bytes

    runtime, spec = ascend_example_runtime(), llama2(80, 8192, 64, 8, 28672)
    with pytest.raises(MemoryPlanError, match=r"does not hold the weights \(131563 MB\)"):
        plan_memory(spec, runtime)
    share = rank_spec(spec, 8)
    assert (share.num_heads, share.num_kv_heads, share.intermediate_size) == (8, 1, 3584)
    resolved, plan = plan_memory(share, runtime, weights_bytes(share, runtime), ranks=8)
    assert plan.weights_mb == pytest.approx(17323, abs=1)
    assert plan.block_mb == pytest.approx(80 * 2 * 128 * 2 * 16 / MB)  # 640 KB a block
    # after the reserves, HCCL's buffers among them (64012 blocks before them, and the prefill scores)
    assert resolved.num_blocks == 60740 and plan.total_mb <= 58000
    assert "HCCL buffers: 400 MB" in plan.describe()
    assert rank_spec(spec, 3).num_kv_heads == 3  # 8 heads over 3 ranks: 3 + 3 + 2, planned as 3


def test_gemma_plans_its_pool_for_the_global_layers_and_a_ring_a_seat(gemma_model_path):
    """Gemma 3 270M (config/model_repository.yaml's runtime): 15 of its 18 layers attend a window of
    512, so they keep each slot's ring of ceil((511 + 512) / 16) = 64 blocks and the pool's blocks
    hold the 3 global layers' K and V only: 3 x 2 x 256 x 4 bytes = 6 KB a position instead of 36."""
    from agent.model.formats import gguf_file

    spec, weights = gguf_file.stored_weights(gemma_model_path)
    runtime = RuntimeSection(
        num_slots=16,
        max_seq_len="auto",
        memory_budget_mb=2048,
        prefill_buckets=[32, 64, 128, 512],
        decode_batch_buckets=[1, 4, 8, 16],
        attend_buckets=[256, 512, 2048],
        compile_cache_dir=None,
    )
    resolved, plan = plan_memory(spec, runtime, weights)
    position = 2 * 256 * 4
    assert plan.block_mb == pytest.approx(3 * position * 16 / MB)
    assert plan.rings_mb == pytest.approx(17 * 64 * 16 * 15 * position / MB)  # 16 slots + scratch
    assert resolved.max_seq_len == 32768 and plan.total_mb <= 2048
    assert plan.num_blocks * 16 >= 4 * 32768  # the budget holds four whole contexts' global layers
    assert "sliding-window layers' rings 510 MB" in plan.describe()


def test_a_tensor_parallel_agent_plans_its_rank_share(tiny_llama_dir):
    """An agent of a group of 2 plans with its share (1 of the 2 KV heads): the same budget holds
    twice the blocks it holds for the whole model (before, every rank planned the whole model)."""
    from agent.bootstrap import Placement, prepare_checkpoint
    from agent.graphs.layers import TensorSplit
    from config.schema import ServingConfig

    runtime = TINY_RUNTIME.model_copy(update={"memory_budget_mb": 8})
    config = ServingConfig(model={"path": str(tiny_llama_dir)}, runtime=runtime)
    checkpoint = load_checkpoint(tiny_llama_dir)
    whole = prepare_checkpoint(config, Placement(None), lambda _: None, checkpoint)[1].num_blocks
    rank = prepare_checkpoint(config, Placement(None, split=TensorSplit(1, 2)), lambda _: None, checkpoint)
    assert rank[1].num_blocks >= 2 * whole - 1


def test_an_encoders_default_prefill_buckets_reach_its_longest_input():
    """An encoder computes each input whole in one call: the default buckets double up to its context
    (or max_seq_len), so its longest input is the model's, not 512; buckets the user set stay."""
    encoder = llama2(2, 256, 4, 4, 512).model_copy(update={"bidirectional": True, "max_context": 2048})
    runtime = RuntimeSection(num_slots=4, max_seq_len="auto", memory_budget_mb=2000, compile_cache_dir=None)
    resolved = plan_memory(encoder, runtime)[0]
    assert resolved.prefill_buckets == [32, 64, 128, 512, 1024, 2048] and resolved.max_seq_len == 2048
    shorter = RuntimeSection(num_slots=4, max_seq_len=768, memory_budget_mb=2000, compile_cache_dir=None)
    assert plan_memory(encoder, shorter)[0].prefill_buckets == [32, 64, 128, 512, 768]
    chosen = RuntimeSection(num_slots=4, max_seq_len="auto", memory_budget_mb=2000, **BUDGETED)
    assert plan_memory(encoder, chosen)[0].prefill_buckets == [32, 64]
    decoder = encoder.model_copy(update={"bidirectional": False})
    assert plan_memory(decoder, runtime)[0].prefill_buckets == [32, 64, 128, 512]
