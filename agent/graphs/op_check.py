"""A static check of the graphs a configuration builds for Ascend, run on CPU: each step graph is
traced to MindIR as `mindspore.export` does (MindSpore's front end only: no kernel is selected or
compiled, so graphs of Ascend-only ops such as PagedAttention trace here), and every operator node
must be on ASCEND_OPS, never `Custom` (this project's CPU kernels). `python -m tools.ascend_ops`
prints the list; tests/integration/agent/test_ascend_graphs.py holds it.

What this does not check: shapes and dtypes each Ascend kernel accepts, and how it compiles. That
needs MindSpore's Ascend plugin, which loads only with the CANN toolkit (README "On Ascend": the
dry run, MS_SIMULATION_LEVEL)."""

from __future__ import annotations

import mindspore as ms
import numpy as np
from mindspore import Tensor, nn
from mindspore.train import mind_ir_pb2
from mindspore.train.serialization import _cell_info

from agent.contract.step import StepChunk
from agent.graphs.interface import mixed_rows
from agent.graphs.step_graphs import StepGraphs
from config.schema import RuntimeSection

# Operators that MindSpore runs on Ascend and these graphs use: each one's API page (in MindSpore
# 2.10's own docstrings: the primitive's, or its function's, mindspore.ops.add for Add, ...) lists
# Ascend among its "Supported Platforms". ReshapeAndCache and PagedAttention are the inference kernels
# vllm-mindspore and MindFormers run on 910B (CANN ATB's ReshapeAndCacheOperation and
# PagedAttentionOperation); their docstrings still say "no backend implementation in MindSpore", but
# the 2.10 wheel ships their 910B kernels (lib/plugin/ascend/ms_kernels_internal/internal_kernel/
# op_kernels/ascend910b: libreshape_and_cache_ascend910b.so, paged_attention_v2). A new op fails the
# check until it is looked up and added here.
ASCEND_OPS = frozenset(
    {
        "Add",
        "AllReduce",  # tensor parallelism (HCCL)
        "Argmax",
        "BatchMatMul",
        "Cast",
        "Concat",  # QK-norm (Qwen3)
        "Div",  # the MoE router's renormalized weights
        "DynamicQuantExt",  # int8 checkpoints' per-token activations (agent/graphs/quant_matmul.py)
        "ExpandDims",
        "FlashAttentionScore",  # prompts on the paged backend (TH layout, MindSpore's internal kernel)
        "Gather",
        "GatherNd",  # the paged cache's K/V transfers
        "GroupedMatmulV4",  # Qwen3-MoE's experts on Ascend (agent/graphs/moe.py AscendExperts)
        "InnerMoeTokenUnpermute",  # MoeTokenUnpermute's primitive: the experts' rows summed back
        "MatMul",
        "MoeGatingTopKSoftmax",  # the MoE router's top-k
        "MoeInitRoutingV2",  # rows grouped by expert
        "Mul",
        "PagedAttention",
        "QuantBatchMatmul",  # W8A8 checkpoints' products, as vllm-ascend runs them
        "QuantV2",  # W8A8's static activation quantization
        "ReduceMean",
        "Reshape",
        "ReshapeAndCache",
        "Rsqrt",
        "ScatterNdUpdate",  # the paged cache's K/V transfers
        "ScatterUpdate",  # the gather path's cache writes
        "SiLU",
        "Softmax",
        "Split",
        "Square",
        "Stack",
        "StridedSlice",
        "SumExt",  # ops.sum
        "TensorToTuple",  # FlashAttentionScore's lengths, as vllm-mindspore passes them (a host op)
        "TopK",
        "Transpose",
        "WeightQuantBatchMatmul",  # int8 weights with float activations (msModelSlim W8A16)
    }
)
# Nodes of the graph itself (ordering, tuples and lists, parameter loads, constants), not operators:
# MindSpore gives them no device kernel.
GRAPH_NODES = frozenset(
    {"Constant", "Depend", "Load", "MakeTuple", "make_list", "TupleGetItem", "UpdateState", "Return"}
)


def traced_model(cell: nn.Cell, inputs: tuple[Tensor, ...]) -> mind_ir_pb2.ModelProto:
    """`cell`'s graph for `inputs` as MindIR: the front end of mindspore.export, without the
    parameters' data."""
    stream, _ = _cell_info(cell, True, *inputs)
    model = mind_ir_pb2.ModelProto()
    model.ParseFromString(stream)
    return model


def traced_ops(cell: nn.Cell, inputs: tuple[Tensor, ...]) -> set[str]:
    """The operator types of `cell`'s graph for `inputs` (every function, lazily inlined layers
    included)."""
    model = traced_model(cell, inputs)
    nodes = [*model.graph.node, *(node for function in model.functions for node in function.node)]
    # an operator node's type reads "REF::MatMul:12"; a call of another function names that function
    return {
        _op_name(node.op_type)
        for node in nodes
        if node.op_type.startswith("REF::") or "::" not in node.op_type
    }


def _op_name(op_type: str) -> str:
    return op_type.removeprefix("REF::").split(":")[0]


def step_graph_ops(
    graphs: StepGraphs, runtime: RuntimeSection, compile_graphs: bool = False
) -> dict[str, set[str]]:
    """The operator types of each graph the runner calls (built for `runtime`): prefill (its
    smallest bucket), decode (its smallest batch), the mixed step where these graphs run one, argmax
    and top-k. compile_graphs: each is also compiled for MindSpore's device (on Ascend: its kernels
    selected and built, which MindSpore's dry run does without an NPU)."""
    inputs = graphs.inputs
    table = inputs.table(np.zeros(1, np.int32), 1)
    one, zero = np.ones(1, np.int64), np.zeros(1, np.int64)
    logits = (Tensor(np.zeros((1, graphs.spec.vocab_size), np.float32)),)
    calls: dict[str, tuple[nn.Cell, tuple[np.ndarray, ...] | tuple[Tensor, ...]]] = {
        "prefill": (graphs.prefill_graph, inputs.prefill(table, one, runtime.prefill_buckets[0])),
        "decode": (
            graphs.decode_graph,
            inputs.decode(table[None], one, zero, runtime.decode_batch_buckets[0], inputs.attend(zero)),
        ),
        "argmax": (graphs.argmax_graph, logits),
        "topk": (graphs.topk_graphs[graphs.topk_buckets[0]], logits),
    }
    rows = mixed_rows(runtime)
    if inputs.fused_layers and rows:
        chunk = StepChunk(slot=1, tokens=[1, 1], table=table, start=0)
        calls["mixed"] = (graphs.mixed_graph, inputs.mixed(table[None], one, one, [chunk], rows, 1))
    if not inputs.ring:  # a disaggregated group's K/V transfers (none for sliding-window models)
        moved, cache = inputs.kv_rows(table, 1), graphs.model.cache_layers[0].k_cache
        blocks = np.zeros((2 * len(graphs.model.cache_layers), len(moved), *cache.shape[moved.ndim :]))
        calls["kv_export"] = (graphs.kv_export_graph, (moved,))
        calls["kv_import"] = (graphs.kv_import_graph, (moved, blocks.astype(ms.dtype_to_nptype(cache.dtype))))
    found = {}
    for name, (cell, args) in calls.items():
        if graphs.model.paged and name in ("prefill", "decode", "mixed"):
            tensors = graphs.paged_tensors(args)
        else:
            tensors = tuple(a if isinstance(a, Tensor) else Tensor(a) for a in args)
        found[name] = traced_ops(cell, tensors)
        if compile_graphs:
            cell.compile(*tensors)
    return found


def small_shapes(runtime: RuntimeSection) -> RuntimeSection:
    """`runtime` with every choice that selects ops kept (target, dtype, attention, matmul, block
    size) and small shapes, whose graphs trace in seconds: the ops do not depend on the sizes."""
    return RuntimeSection.model_validate(
        runtime.model_dump()
        | {
            "num_slots": 4,
            "max_seq_len": 64,
            "num_blocks": "auto",
            "memory_budget_mb": None,
            "prefill_buckets": [16, 64],
            "decode_batch_buckets": [1, 4],
            "attend_buckets": [32, 64],
            "compile_cache_dir": None,
        }
    )


def not_on_ascend(ops: set[str]) -> list[str]:
    """The operator types of `ops` that MindSpore's Ascend backend does not run (Custom included)."""
    return sorted(op for op in ops - GRAPH_NODES if op not in ASCEND_OPS)
