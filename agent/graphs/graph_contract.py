"""The contract between the paged step graphs and MindSpore's Ascend inference kernels, checked
statically on CPU (no NPU here): each graph of the paged backend (agent/graphs/step_graphs.py
PagedStepGraph) is traced to MindIR at its dynamic input shapes, and then

- its inputs must be the upstream ones, by name, dtype and rank (STEP_INPUTS: the internal
  PagedAttention kernel reads `batch_valid_length` and `q_seq_lens` from the graph inputs so named);
- each operand of every ReshapeAndCache, PagedAttention and FlashAttentionScore node must come from
  the input (or the layer's cache Parameter) that vllm-mindspore's Attention layer passes there
  (UPSTREAM_WIRING; the operand names are the wheel's own, its primitives' call signatures);
- every layer writes once and attends once, its attention's query ordered after its own write
  (an ops.depend on the ReshapeAndCache);
- the caches are [blocks, block_size, KV heads, head_dim] in the model's dtype, the kernels'
  attributes (heads, KV heads, scale 1: the queries come scaled, the TH layout) the model's;
- the context the agent sets (runtime.jit_config: O0 and infer_boost) and the graphs' predict
  phases (`prefill` for prompts, `increment` for the rest) are the ones that select the internal
  kernels.

tools/ascend_ops.py prints what it checked; agent/graphs/op_check.py checks the op list."""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field

from mindspore import nn
from mindspore.ops.auto_generate import FlashAttentionScore, PagedAttention, ReshapeAndCache
from mindspore.train import mind_ir_pb2

from agent.graphs.op_check import traced_model
from agent.graphs.step_graphs import StepGraphs
from config.schema import RuntimeSection

# The step graphs' inputs as vllm-mindspore's model_base.py names them: (name, dtype, rank); "model":
# the model's dtype
STEP_INPUTS = (
    ("input_ids", "INT32", 1),
    ("positions", "INT32", 1),
    ("slot_mapping", "INT32", 1),
    ("batch_valid_length", "INT32", 1),
    ("q_seq_lens", "INT32", 1),
    ("block_tables", "INT32", 2),
    ("attn_mask", "model", 2),
    ("logit_rows", "INT32", 1),
)
# Operand -> where upstream's Attention layer takes it from: a step input, or the layer's cache
# Parameter (k_cache, v_cache). The rest (query, key, value) are the layer's own rows.
UPSTREAM_WIRING = {
    "ReshapeAndCache": {"key_cache": "k_cache", "value_cache": "v_cache", "slot_mapping": "slot_mapping"},
    "PagedAttention": {
        "key_cache": "k_cache",
        "value_cache": "v_cache",
        "block_tables": "block_tables",
        "context_lens": "batch_valid_length",
        "attn_mask": "attn_mask",
        "q_seq_lens": "q_seq_lens",
    },
    "FlashAttentionScore": {
        "attn_mask": "attn_mask",
        "actual_seq_qlen": "q_seq_lens",
        "actual_seq_kvlen": "batch_valid_length",
    },
}
OPERANDS = {
    prim.__name__: list(inspect.signature(prim.__call__).parameters)[1:]
    for prim in (ReshapeAndCache, PagedAttention, FlashAttentionScore)
}
ATTENTION = {"prefill": "FlashAttentionScore", "increment": "PagedAttention"}
# Nodes an operand passes through unchanged in value (a Parameter's Load, an ordering Depend's first
# input, a reshape, the int64 cast and host conversion of FlashAttentionScore's lengths, which the
# front end inserts for vllm-mindspore's int32 tensors alike)
PASS_THROUGH = {"Load", "Depend", "Reshape", "Cast", "TensorToTuple"}
MINDIR_TYPES = {"float32": "FLOAT", "float16": "FLOAT16", "bfloat16": "BFLOAT16"}


@dataclass(frozen=True)
class InputUse:
    """One input of one graph, and the kernel operands it feeds (with how many nodes each)."""

    graph: str
    name: str
    dtype: str
    shape: tuple[int, ...]
    feeds: tuple[str, ...]


@dataclass
class ContractReport:
    context: dict[str, str]
    phases: dict[str, str]
    inputs: list[InputUse] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)

    def lines(self) -> list[str]:
        """The contract as it was checked, one line a graph input, then the problems."""
        out = [
            f"context: jit_config {self.context}; phases "
            + ", ".join(f"{graph} {phase}" for graph, phase in self.phases.items())
        ]
        for use in self.inputs:
            shape = "[" + ", ".join("?" if d < 0 else str(d) for d in use.shape) + "]"
            feeds = ", ".join(use.feeds) or "the layers (not a kernel operand)"
            out.append(f"{use.graph}: {use.name} {use.dtype}{shape} -> {feeds}")
        return out + [f"problem: {p}" for p in self.problems]


def check_contract(graphs: StepGraphs, runtime: RuntimeSection) -> ContractReport:
    """The contract of `graphs` (built for `runtime`, paged) against the upstream one."""
    report = ContractReport(runtime.jit_config, {})
    if runtime.jit_config.get("jit_level") != "O0" or runtime.jit_config.get("infer_boost") != "on":
        report.problems.append(
            f"jit_config {runtime.jit_config}: the internal kernels need jit_level O0 and infer_boost on "
            "(device_target Ascend, decode_attention paged)"
        )
    if not graphs.model.paged:
        report.problems.append("the graphs do not run the paged backend (decode_attention: paged)")
        return report
    for phase, graph in (("prefill", graphs.prefill_graph), ("increment", graphs.decode_graph)):
        report.phases[phase] = graph.phase
        if graph.phase != phase:
            report.problems.append(f"the {phase} graph runs in phase {graph.phase!r}, not {phase!r}")
        _check_graph(phase, graph, graphs, runtime, report)
    _check_attributes(graphs, report)
    return report


def _check_graph(
    phase: str, graph: nn.Cell, graphs: StepGraphs, runtime: RuntimeSection, report: ContractReport
) -> None:
    """One traced graph against the contract: its inputs' names, the kernels' operands, the order of
    each layer's write and attention, the inputs' dtypes and ranks, the caches' shapes."""
    traced = _Traced(traced_model(graph, graph.get_inputs()))
    want_dtype = MINDIR_TYPES[runtime.dtype]
    names = [name.rsplit(":", 1)[-1] for name in traced.inputs]
    expected = [name for name, _, _ in STEP_INPUTS]
    if names != expected:
        report.problems.append(f"{phase}: inputs {names}, upstream's are {expected}")
    feeds = _check_wiring(phase, traced, names, len(graphs.model.layers), report)
    _check_ordering(phase, traced, report)
    _check_inputs(phase, traced, feeds, want_dtype, report)
    cache = (
        graphs.model.layers[0].k_cache.shape[0],
        runtime.block_size,
        graphs.model.kv_heads,
        graphs.spec.head_dim,
    )
    for name, (dtype, shape) in traced.parameters.items():
        if name.endswith(("k_cache", "v_cache")) and (shape != cache or dtype != want_dtype):
            report.problems.append(
                f"{phase}: {name} is {dtype}{list(shape)}, the kernels read {want_dtype}{list(cache)}"
            )


def _check_wiring(
    phase: str, traced: _Traced, names: list[str], layers: int, report: ContractReport
) -> dict[str, dict[str, int]]:
    """Each kernel node per layer, each operand from where upstream takes it; returns, per graph
    input, the operands it feeds with how many nodes each."""
    feeds: dict[str, dict[str, int]] = {name: {} for name in names}
    for op in ("ReshapeAndCache", ATTENTION[phase]):
        nodes = traced.nodes_of(op)
        if len(nodes) != layers:
            report.problems.append(f"{phase}: {len(nodes)} {op} nodes for {layers} layers")
        for node in nodes:
            for operand, source in zip(OPERANDS[op], node.input):
                found = traced.source(source)
                if found in feeds:
                    use = f"{op}.{operand}"
                    feeds[found][use] = feeds[found].get(use, 0) + 1
                want = UPSTREAM_WIRING[op].get(operand)
                if want is not None and not (found == want or found.endswith("." + want)):
                    report.problems.append(
                        f"{phase}: {op}.{operand} comes from {found}, upstream's from {want}"
                    )
    return feeds


def _check_ordering(phase: str, traced: _Traced, report: ContractReport) -> None:
    """Each attention's query ordered after its layer's cache write."""
    for node in traced.nodes_of(ATTENTION[phase]):
        if not traced.ordered_after_write(node.input[0]):
            report.problems.append(
                f"{phase}: a {ATTENTION[phase]}'s query is not ordered after its layer's write"
            )


def _check_inputs(
    phase: str, traced: _Traced, feeds: dict[str, dict[str, int]], want_dtype: str, report: ContractReport
) -> None:
    """Each graph input's dtype and rank against upstream's, and its line in the report."""
    specs = {name: (dtype, rank) for name, dtype, rank in STEP_INPUTS}
    for name, (dtype, shape) in traced.inputs.items():
        short = name.rsplit(":", 1)[-1]
        spec = specs.get(short)
        if spec is not None:
            want = want_dtype if spec[0] == "model" else spec[0]
            if dtype != want or len(shape) != spec[1]:
                found = f"{dtype} of rank {len(shape)}"
                report.problems.append(
                    f"{phase}: input {short} is {found}, upstream's {want} of rank {spec[1]}"
                )
        uses = tuple(f"{use} x{count}" for use, count in feeds.get(short, {}).items())
        report.inputs.append(InputUse(phase, short, dtype, shape, uses))


def _check_attributes(graphs: StepGraphs, report: ContractReport) -> None:
    """The kernels' attributes: the model's heads, scale 1 (queries come scaled), the TH layout."""
    backend = graphs.model.layers[0].paged_attention
    paged = getattr(backend, "paged_attention", None)
    if paged is None:
        report.problems.append(
            "the layers run the reference backend, not the Ascend kernels (device_target Ascend)"
        )
        return
    flash = backend.flash_attention
    found = (
        paged.head_num,
        paged.kv_head_num,
        paged.scale_value,
        flash.head_num,
        flash.scale_value,
        flash.input_layout,
    )
    spec = graphs.model.layers[0]
    layout = FlashAttentionScore(spec.heads, input_layout="TH").input_layout  # held as the wheel's enum
    want = (spec.heads, spec.kv_heads, 1.0, spec.heads, 1.0, layout)
    if found != want:
        report.problems.append(
            "kernel attributes (PagedAttention head_num, kv_head_num, scale_value; FlashAttentionScore "
            f"head_num, scale_value, input_layout (TH: {layout})) are {found}, the model's {want}"
        )


class _Traced:
    """A traced graph's nodes by output, its inputs and Parameters by name with (dtype, shape)."""

    def __init__(self, model: mind_ir_pb2.ModelProto):
        self.by_output = {out: node for node in model.graph.node for out in node.output}
        self.inputs = {
            value.name: (_dtype(value.tensor[0].data_type), tuple(value.tensor[0].dims))
            for value in model.graph.input
        }
        self.parameters = {
            p.name.rsplit(":", 1)[-1]: (_dtype(p.data_type), tuple(p.dims)) for p in model.graph.parameter
        }
        self.nodes = list(model.graph.node)

    def nodes_of(self, op: str) -> list:
        return [node for node in self.nodes if _op_type(node) == op]

    def source(self, name: str) -> str:
        """Where a value comes from: an input or Parameter's short name, "none" for a constant (an
        omitted operand), or "<Op>" for a computed value."""
        while name in self.by_output:
            node = self.by_output[name]
            if _op_type(node) not in PASS_THROUGH:
                return f"<{_op_type(node)}>"
            name = node.input[0]
        if name in self.inputs or name.rsplit(":", 1)[-1] in self.parameters:
            return name.rsplit(":", 1)[-1]
        return "none"

    def ordered_after_write(self, name: str) -> bool:
        """Whether the value `name` passes through a Depend on a ReshapeAndCache's output."""
        while name in self.by_output:
            node = self.by_output[name]
            if _op_type(node) == "Depend" and any(
                _op_type(self.by_output.get(i)) == "ReshapeAndCache" for i in node.input[1:]
            ):
                return True
            if _op_type(node) not in PASS_THROUGH:
                return False
            name = node.input[0]
        return False


def _op_type(node) -> str:
    return "" if node is None else node.op_type.removeprefix("REF::").split(":")[0]


def _dtype(code: int) -> str:
    return mind_ir_pb2.TensorProto.DataType.Name(code)
