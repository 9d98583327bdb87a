"""Memory planning: the KV block pool an agent holds, and how long a sequence may be, from the
model's sizes and runtime.memory_budget_mb (or the numbers the config gives), with the plan in
words for the log.

    weights   each tensor at the size the graphs hold it (Checkpoint.weight_bytes: a GGUF's matrices
              kept in their format at the file's size, with the matmul kernel), or parameters x dtype
              size where only the model's spec is known (MindIR exports)
    KV block  layers x 2 (K and V) x kv_heads x head_dim x dtype size x block_size positions (the
              global layers only where sliding-window layers keep rings of their own)
    pool      num_blocks (what the budget leaves, or num_slots x ceil(max_seq_len / block_size)
              without one) + the scratch blocks that padding writes to
    rings     sliding-window layers (Gemma 3's local layers): (num_slots + 1) slots' rings of
              ceil((window - 1 + the largest prefill bucket) / block_size) blocks each, whatever
              the sequences' lengths (agent/graphs/interface.py)
    working   prefill attention scores of every layer at the largest prefill bucket (fp32),
              logits of the largest decode batch, the RoPE tables (cos and sin of every
              position: 134 MB for Gemma 3's two bases over its 32768 positions), and on the
              gather decode path one layer's K and V gathered for the largest decode batch over
              max_seq_len positions
    reserves  on Ascend and GPU only, each a line of the plan:
              kernel workspace: the internal kernels' workspace and tiling data and the memory
                pool's fragmentation, a stated margin (KERNEL_WORKSPACE_MB + KERNEL_WORKSPACE_SHARE
                of the budget): nothing here can measure it;
              graph inputs/outputs: measured on the arrays GraphInputs builds for every compiled
                step graph, and the largest step's outputs (logits [rows, vocab] float32 and what
                the post-process graphs make of them);
              HCCL buffers: tensor parallelism's communicator, 2 x HCCL_BUFFSIZE (CANN's default
                200 MB), outside MindSpore's pool;
              and the working line is the prompt path's workspace there: the prefill scores (none
              on Ascend's paged kernels, which tile them on chip) and RoPE tables as on CPU, one
              layer's activations of the largest prefill bucket, the logits counted with the graph
              outputs instead
    total     weights + pool x KV block + working + reserves
    ranks     tensor parallelism: every figure of one rank's share (rank_spec), the pool as large on
              every rank

After warm-up, check_peak holds MindSpore's peak allocation to the plan (on Ascend and GPU).

Slots (num_slots: sequences placed at once) cost no KV: their sequences take blocks as they grow,
so a pool smaller than every slot's whole length serves many short sequences and a few long ones.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from agent.contract.sampling import SamplingParams
from agent.contract.step import StepChunk
from agent.graphs.cache_format import VALUE_BYTES, CacheFormat
from agent.graphs.interface import GraphInputs, local_ring_blocks, mixed_rows, scratch_blocks
from agent.graphs.shapes import held_rows
from agent.launcher.memory_budget import available_mb
from agent.model.checkpoint import Checkpoint
from agent.model.formats import gguf_file
from agent.model.spec import ModelSpec
from config.schema import RuntimeSection

MB = 1 << 20
LENGTH_STEP = 256  # a planned max_seq_len is a multiple of this

# The kernel workspace reserve. MindSpore's internal kernels (PagedAttention, ReshapeAndCache,
# MatMul) take their workspace and tiling data from the pool at each launch; no NPU here measures
# them. At these shapes a kernel's workspace is a few to tens of MB (PagedAttention's split-KV
# partials: rows x heads x splits x head_dim float32), so 1 GB is an order of magnitude over one
# kernel's; the share of the budget is for the pool's fragmentation, which grows with the pool.
# check_peak, after warm-up, is the measurement that says whether this was enough.
KERNEL_WORKSPACE_MB = 1024
KERNEL_WORKSPACE_SHARE = 0.02
# CANN's HCCL_BUFFSIZE default (MB): each communicator holds 2 x HCCL_BUFFSIZE, to send and to
# receive, allocated by HCCL outside MindSpore's pool (CANN's environment-variable reference).
HCCL_BUFFSIZE_MB = 200
# The graphs' AllReduce runs on MindSpore's world group (agent/graphs/decoder.py), the one
# communicator init() makes for a tensor-parallel group (agent/bootstrap.py _join_cluster).
HCCL_COMMUNICATORS = 1


class MemoryPlanError(ValueError):
    """The budget cannot hold the model with at least one slot; the message says what to change."""


@dataclass(frozen=True, kw_only=True)
class Reserve:
    """Device memory the plan sets aside beside the weights, the KV cache and working memory."""

    name: str
    mb: float
    basis: str  # how the figure was reached, for the plan's line
    pooled: bool = True  # in MindSpore's memory pool (HCCL allocates its buffers outside it)


@dataclass(frozen=True)
class MemoryPlan:
    weights_mb: float
    block_mb: float  # one block of every layer's K and V
    working_mb: float
    num_slots: int
    max_seq_len: int
    num_blocks: int
    scratch_blocks: int
    block_size: int
    budget_mb: int | None
    rings_mb: float = 0.0  # the sliding-window layers' rings, every slot's
    states_mb: float = 0.0  # the Gated DeltaNet layers' states: every slot's, the scratch one's, snapshots
    state_snapshots: int = 0
    kv_format: str = "float32"  # the cache's rows (agent/graphs/cache_format.py)
    reserves: tuple[Reserve, ...] = ()  # Ascend and GPU only
    working_basis: str = ""  # what the working line holds, said where there are reserves

    @property
    def kv_mb(self) -> float:
        return (self.num_blocks + self.scratch_blocks) * self.block_mb + self.rings_mb

    @property
    def reserves_mb(self) -> float:
        return sum(reserve.mb for reserve in self.reserves)

    @property
    def total_mb(self) -> float:
        return self.weights_mb + self.kv_mb + self.states_mb + self.working_mb + self.reserves_mb

    @property
    def pooled_mb(self) -> float:
        """What MindSpore's memory pool should hold at its peak: the plan less HCCL's buffers."""
        return self.total_mb - sum(reserve.mb for reserve in self.reserves if not reserve.pooled)

    def describe(self) -> str:
        """The plan in words: one line, then on Ascend and GPU a line per reserve."""
        budget = f" of a {self.budget_mb} MB budget" if self.budget_mb else ""
        positions = self.num_blocks * self.block_size
        reserves = f", reserves {self.reserves_mb:.0f} MB" if self.reserves else ""
        lines = [f"  working: {self.working_mb:.0f} MB ({self.working_basis})"] if self.reserves else []
        lines += [f"  {reserve.name}: {reserve.mb:.0f} MB ({reserve.basis})" for reserve in self.reserves]
        return (
            f"memory plan: weights {self.weights_mb:.0f} MB, KV cache {self.kv_mb:.0f} MB"
            + (f" ({self.kv_format})" if self.kv_format == "q8_0" else "")
            + f": {self.num_blocks} blocks of {self.block_size} positions ({positions} positions, "
            f"{positions / self.max_seq_len:.1f} sequences of max_seq_len {self.max_seq_len}) "
            f"shared by {self.num_slots} slots"
            + (
                f" (global layers; sliding-window layers' rings {self.rings_mb:.0f} MB)"
                if self.rings_mb
                else ""
            )
            + (
                f", Gated DeltaNet states {self.states_mb:.0f} MB ({self.num_slots} slots, a scratch one and "
                f"{self.state_snapshots} snapshots)"
                if self.states_mb
                else ""
            )
            + f", working {self.working_mb:.0f} MB{reserves}: "
            f"{self.total_mb:.0f} MB{budget}" + "".join("\n" + line for line in lines)
        )


def weights_bytes(spec: ModelSpec, runtime: RuntimeSection) -> int:
    """The weights' memory from the model's spec alone (all dense in runtime.dtype)."""
    return spec.parameter_count() * VALUE_BYTES[runtime.dtype]


def rank_spec(spec: ModelSpec, ranks: int) -> ModelSpec:
    """The sizes one rank of a tensor-parallel group of `ranks` holds, as the graphs split a layer:
    its KV heads with their query heads and its share of the FFN columns (the first rank's, the
    largest: every rank then plans the same pool), the embedding, output head and norms whole."""
    if ranks == 1:
        return spec
    kv_heads = -(-spec.num_kv_heads // ranks)
    return spec.model_copy(
        update={
            "num_kv_heads": kv_heads,
            "num_heads": kv_heads * spec.group_size,
            "intermediate_size": -(-spec.intermediate_size // ranks),
            "expert_intermediate_size": -(-spec.expert_intermediate_size // ranks),
        }
    )


def checkpoint_weights_bytes(checkpoint: Checkpoint, runtime: RuntimeSection) -> int:
    """The weights' memory as the graphs will hold them: with the matmul kernel in float32, every
    tensor at its size in the checkpoint (matrices kept in a GGUF's format at the file's size, the
    embedding once whether tied or not); otherwise every tensor dense in runtime.dtype."""
    if runtime.matmul_kernel and runtime.dtype == "float32":
        return checkpoint.weight_bytes()
    return weights_bytes(checkpoint.spec, runtime)


def working_bytes(spec: ModelSpec, runtime: RuntimeSection) -> int:
    """Working memory (module docstring): on Ascend and GPU the prompt path's workspace, the logits
    counted with the graph outputs (graph_io_reserve)."""
    longest = runtime.prefill_buckets[-1]
    scores = spec.num_layers * spec.num_heads * longest * longest * 4
    # On Ascend the paged backend's kernels (FlashAttentionScore, PagedAttention) tile the scores on
    # chip: none in device memory beyond their workspace (the kernel workspace reserve)
    if runtime.paged_attention and runtime.device_target == "Ascend":
        scores = 0
    positions = spec.max_context if runtime.max_seq_len == "auto" else runtime.max_seq_len
    tables = 2 if spec.local_layers and spec.rope_local_theta is not None else 1
    rope = tables * 2 * positions * spec.head_dim * 4
    # the gather decode path (GPU; Ascend with decode_attention: gather) copies one layer's K and V of
    # the largest batch over the largest attend bucket (max_seq_len) before its matmuls: a pool capped
    # at the budget leaves it room. (The paged backend's reference, off Ascend, gathers as much.) On
    # Ascend PagedAttention reads the blocks in place.
    gather = 0
    if not runtime.attention_kernel and not (runtime.paged_attention and runtime.device_target == "Ascend"):
        gather = 2 * runtime.decode_batch_buckets[-1] * positions * spec.num_kv_heads
        gather *= spec.head_dim * VALUE_BYTES[runtime.dtype]
    if runtime.device_target == "CPU":
        return scores + runtime.decode_batch_buckets[-1] * spec.vocab_size * 4 * 2 + rope + gather
    return scores + rope + gather + prompt_activation_bytes(spec, runtime)


def prompt_activation_bytes(spec: ModelSpec, runtime: RuntimeSection) -> int:
    """One layer's activations for the largest prefill bucket's rows (a mixed step has no more):
    the residual stream, its norm, the attention's and the FFN's outputs (4 x hidden), Q and the
    attention's heads (2 x heads x head_dim), K and V, and the gated FFN's gate, up and product
    (3 x its width: a MoE row's chosen experts' and shared expert's together). A layer's are dead
    once its output is written, so one layer's count."""
    q, kv = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
    dense = spec.intermediate_size if spec.num_experts == 0 or spec.dense_layers else 0
    routed = spec.experts_per_token * spec.expert_intermediate_size + spec.shared_expert_intermediate_size
    ffn = max(dense, routed)
    width = 4 * spec.hidden_size + 2 * q + 2 * kv + 3 * ffn
    return runtime.prefill_buckets[-1] * width * VALUE_BYTES[runtime.dtype]


def graph_input_bytes(spec: ModelSpec, runtime: RuntimeSection, slots: int) -> list[int]:
    """The bytes of each compiled step graph's inputs, as GraphInputs builds them: the prefill per
    bucket (and its variant returning every row's logits, for prompt logprobs), the decode per
    batch bucket and attended length, the mixed step per batch bucket, at the longest max_seq_len
    the plan may give (the block tables' width). The post-process graphs take the step's logits
    where they lie."""
    longest = spec.max_context if runtime.max_seq_len == "auto" else runtime.max_seq_len
    shaped = runtime.model_copy(
        update={
            "num_slots": slots,
            "max_seq_len": longest,
            "num_blocks": -(-longest // runtime.block_size),  # the pool's size is no input's
            "attend_buckets": sorted({b for b in runtime.attend_buckets if b < longest} | {longest}),
        }
    )
    fused = shaped.paged_attention  # the CPU kernels' layers do not run on Ascend or GPU
    ring = local_ring_blocks(shaped, spec, longest)
    inputs = GraphInputs(shaped, spec.num_kv_heads, spec.group_size, fused, ring)
    scratch = inputs.scratch_table

    def nbytes(arrays: tuple[np.ndarray, ...]) -> int:
        return sum(np.asarray(array).nbytes for array in arrays)

    def zeros(rows: int) -> np.ndarray:
        return np.zeros(rows, np.int64)

    sizes = [
        nbytes(inputs.prefill(scratch, zeros(1), length, every_row=every_row))
        for length in shaped.prefill_buckets
        for every_row in (False, True)
    ]
    sizes += [
        nbytes(inputs.decode(np.tile(scratch, (rows, 1)), zeros(rows), zeros(rows), rows, attend))
        for rows in shaped.decode_batch_buckets
        for attend in inputs.decode_attends
    ]
    rows = mixed_rows(shaped) if fused else 0
    if rows:  # a chunk and logit_rows - 1 decode rows
        chunk = StepChunk(0, [0], scratch, 0, SamplingParams())
        sizes += [
            nbytes(inputs.mixed(np.tile(scratch, (n - 1, 1)), zeros(n - 1), zeros(n - 1), [chunk], rows, n))
            for n in shaped.decode_batch_buckets
        ]
    return sizes


def graph_io_reserve(spec: ModelSpec, runtime: RuntimeSection, slots: int) -> Reserve:
    """Every compiled step graph's inputs (their device copies may stay with the graph between
    calls: KBs each), and the outputs alive at once at the largest step: a prefill's logits of
    every row (prompt logprobs), or a decode batch's logits and argmax with the post-process's
    top-k of the whole vocabulary (agent/graphs/step_graphs.py topk_buckets) and argmax of them.
    A step's outputs are read back before the next step runs, so one step's count."""
    inputs = graph_input_bytes(spec, runtime, slots)
    vocab, prompt, batch = spec.vocab_size, runtime.prefill_buckets[-1], runtime.decode_batch_buckets[-1]
    prompt_logits = prompt * vocab * 4
    decode_outputs = batch * vocab * 4 + batch * 4 + batch * vocab * (4 + 4) + batch * 4
    rows = prompt if prompt_logits >= decode_outputs else batch
    return Reserve(
        name="graph inputs/outputs",
        mb=(sum(inputs) + max(prompt_logits, decode_outputs)) / MB,
        basis=f"inputs of {len(inputs)} compiled step graphs {sum(inputs) / MB:.1f} MB; outputs of the "
        f"largest step: logits [{rows}, {vocab}] float32"
        + (" of a prefill scoring its prompt" if rows == prompt else ", their argmax and top-k"),
    )


def hccl_reserve(ranks: int, environ: Mapping[str, str] = os.environ) -> Reserve | None:
    """HCCL's buffers for a tensor-parallel group of `ranks` (None for one rank): each communicator
    2 x HCCL_BUFFSIZE MB (the agent's environment's, else CANN's default)."""
    if ranks <= 1:
        return None
    given = environ.get("HCCL_BUFFSIZE")
    try:
        size = HCCL_BUFFSIZE_MB if given is None else int(given)
    except ValueError:
        raise MemoryPlanError(f"HCCL_BUFFSIZE={given!r} is not a whole number of MB") from None
    return Reserve(
        name="HCCL buffers",
        mb=HCCL_COMMUNICATORS * 2 * size,
        basis=f"{HCCL_COMMUNICATORS} communicator x 2 x HCCL_BUFFSIZE {size} MB, outside MindSpore's pool",
        pooled=False,
    )


def kernel_workspace_reserve(served_bytes: int, of_budget: bool) -> Reserve:
    """The stated margin (KERNEL_WORKSPACE_MB, KERNEL_WORKSPACE_SHARE) of `served_bytes`: the budget,
    or without one the rest of the plan."""
    share = KERNEL_WORKSPACE_SHARE * served_bytes
    what = "the budget" if of_budget else "the rest of the plan"
    return Reserve(
        name="kernel workspace",
        mb=KERNEL_WORKSPACE_MB + share / MB,
        basis=f"{KERNEL_WORKSPACE_MB} MB + {KERNEL_WORKSPACE_SHARE:.0%} of {what}: a stated margin, "
        "not measured here; check_peak measures the whole after warm-up",
    )


def working_basis(spec: ModelSpec, runtime: RuntimeSection) -> str:
    """What the working line holds on Ascend and GPU, for the plan's line."""
    bucket = runtime.prefill_buckets[-1]
    if runtime.paged_attention and runtime.device_target == "Ascend":
        return (
            f"the prompt path: one layer's activations at prefill bucket {bucket}, RoPE tables; the "
            "attention kernels keep their scores on chip"
        )
    return (
        f"the prompt path: attention scores of every layer and one layer's activations at prefill "
        f"bucket {bucket}, RoPE tables, gathered K/V"
    )


def planned_length(spec: ModelSpec, runtime: RuntimeSection, room: int | None) -> int:
    """max_seq_len as set, or (auto) the longest a pool of `room` blocks holds, in LENGTH_STEPs."""
    if runtime.max_seq_len != "auto":
        return runtime.max_seq_len
    assert room is not None, "the runtime's validation asks a budget of max_seq_len auto"
    max_len = min(spec.max_context, room * runtime.block_size // LENGTH_STEP * LENGTH_STEP)
    if max_len < runtime.prefill_buckets[-1]:
        raise MemoryPlanError(
            f"memory_budget_mb {runtime.memory_budget_mb} leaves {room} KV blocks of "
            f"{runtime.block_size} positions: not one sequence of the largest prefill bucket "
            f"({runtime.prefill_buckets[-1]} positions); raise the budget or lower prefill_buckets"
        )
    return max_len


def pool_blocks(runtime: RuntimeSection, slots: int, max_len: int, room: int | None) -> int:
    """num_blocks as set, else all the budget's `room`, else (no budget) each slot its whole length."""
    if runtime.num_blocks != "auto":
        return runtime.num_blocks
    if room is not None:
        return room
    return slots * -(-max_len // runtime.block_size)


def encoder_buckets(spec: ModelSpec, runtime: RuntimeSection) -> RuntimeSection:
    """An encoder's input runs whole in one prefill call (its attention reads the whole input):
    prefill_buckets left at their default grow by doubling to its longest input (max_seq_len, or
    the model's context), so the default serves every input the model takes."""
    if not spec.bidirectional or "prefill_buckets" in runtime.model_fields_set:
        return runtime
    longest = spec.max_context if runtime.max_seq_len == "auto" else runtime.max_seq_len
    buckets = [b for b in runtime.prefill_buckets if b < longest]
    while buckets and buckets[-1] * 2 < longest:
        buckets.append(buckets[-1] * 2)
    return runtime.model_copy(update={"prefill_buckets": [*buckets, longest]})


def plan_memory(
    spec: ModelSpec, runtime: RuntimeSection, weights: int | None = None, ranks: int = 1
) -> tuple[RuntimeSection, MemoryPlan]:
    """The runtime with num_slots, max_seq_len and num_blocks resolved, and the plan; `weights`: the
    weights' bytes (checkpoint_weights_bytes), else estimated from the spec; `ranks`: the
    tensor-parallel group's (`spec` is then one rank's share: rank_spec). Raises MemoryPlanError
    when the budget is too small, naming the sizes."""
    runtime = encoder_buckets(spec, runtime)
    weights = weights_bytes(spec, runtime) if weights is None else weights
    working = working_bytes(spec, runtime)
    slots = runtime.decode_batch_buckets[-1] if runtime.num_slots == "auto" else runtime.num_slots
    # Sliding-window layers keep per-slot rings (unless a ring would hold a whole sequence)
    longest = spec.max_context if runtime.max_seq_len == "auto" else runtime.max_seq_len
    ring = local_ring_blocks(runtime, spec, longest)
    # Gated DeltaNet layers hold no KV: a fixed state per slot instead
    linear = spec.linear_attention
    pool_layers = (spec.global_layers if ring else spec.num_layers) - (len(linear.layers) if linear else 0)
    # each slot's (and the scratch one's) state and held rows, and the snapshots
    states = (
        (slots + 1) * linear.slot_bytes(held_rows(runtime)) + runtime.state_snapshots * linear.state_bytes
        if linear
        else 0
    )
    position_bytes = 2 * spec.num_kv_heads * CacheFormat.of(runtime).row_bytes(spec.head_dim)
    per_block = pool_layers * position_bytes * runtime.block_size
    rings = (slots + 1) * ring * (spec.num_layers - pool_layers) * position_bytes * runtime.block_size
    scratch = scratch_blocks(runtime)
    budget = None if runtime.memory_budget_mb is None else runtime.memory_budget_mb * MB
    device = runtime.device_target != "CPU"
    reserves: list[Reserve] = []
    if device:
        reserves.append(graph_io_reserve(spec, runtime, slots))
        hccl = hccl_reserve(ranks) if runtime.device_target == "Ascend" else None
        reserves += [hccl] if hccl else []
        if budget is not None:
            reserves.insert(0, kernel_workspace_reserve(budget, of_budget=True))
    reserved = sum(int(reserve.mb * MB) for reserve in reserves)
    # what the weights, working memory and reserves leave, in words for the refusals
    beside = f"working memory ({working / MB:.0f} MB)" + (
        f", the reserves ({reserved / MB:.0f} MB: "
        + ", ".join(f"{reserve.name} {reserve.mb:.0f} MB" for reserve in reserves)
        + ")"
        if reserves
        else ""
    )
    # blocks the budget leaves for the pool (None: no budget)
    room = (
        None
        if budget is None
        else (budget - weights - working - rings - states - reserved) // per_block - scratch
    )
    if room is not None and room <= 0:
        raise MemoryPlanError(
            f"memory_budget_mb {runtime.memory_budget_mb} does not hold the weights "
            f"({weights / MB:.0f} MB), {beside}"
            + (f", the sliding-window layers' rings ({rings / MB:.0f} MB)" if rings else "")
            + (f", the Gated DeltaNet layers' states ({states / MB:.0f} MB)" if states else "")
            + " and a KV cache"
        )

    max_len = planned_length(spec, runtime, room)
    blocks = pool_blocks(runtime, slots, max_len, room)
    per_seq = -(-max_len // runtime.block_size)
    if blocks < per_seq or (room is not None and blocks > room):
        need = f"{per_seq} blocks (one sequence of max_seq_len {max_len})"
        raise MemoryPlanError(
            f"num_blocks {blocks} of {runtime.block_size} positions: a pool needs at least {need}"
            + (
                f" and memory_budget_mb {runtime.memory_budget_mb} holds at most {room} "
                f"({per_block / MB:.2f} MB each after the weights ({weights / MB:.0f} MB) and "
                f"{beside})"
                if room is not None
                else ""
            )
            + "; raise the budget or lower max_seq_len"
        )
    update: dict[str, int | list[int]] = {
        "num_slots": int(slots),
        "max_seq_len": int(max_len),
        "num_blocks": int(blocks),
    }
    if runtime.max_seq_len == "auto":  # the attend buckets end at the planned length
        update["attend_buckets"] = sorted({b for b in runtime.attend_buckets if b < max_len} | {max_len})
    try:
        # what the user left out is derived again for the planned length (the default buckets)
        resolved = RuntimeSection.model_validate({**runtime.model_dump(exclude_unset=True), **update})
    except ValueError as exc:
        raise MemoryPlanError(f"the planned runtime ({update}) is not valid: {exc}") from exc
    if device and budget is None:  # the margin's share is of what the plan puts in the pool
        served = weights + working + rings + states + (blocks + scratch) * per_block + reserved
        reserves.insert(0, kernel_workspace_reserve(served, of_budget=False))
    plan = MemoryPlan(
        weights / MB,
        per_block / MB,
        working / MB,
        int(slots),
        int(max_len),
        int(blocks),
        scratch,
        runtime.block_size,
        runtime.memory_budget_mb,
        rings / MB,
        states / MB,
        runtime.state_snapshots if linear else 0,
        CacheFormat.of(runtime).name,
        tuple(reserves),
        working_basis(spec, runtime) if device else "",
    )
    return resolved, plan


def resolve_runtime(
    spec: ModelSpec,
    runtime: RuntimeSection,
    log: Callable[[str], None],
    weights: int | None = None,
    ranks: int = 1,
) -> tuple[RuntimeSection, MemoryPlan]:
    """plan_memory, with the plan logged: what every process that builds a runner calls first."""
    resolved, plan = plan_memory(spec, runtime, weights, ranks)
    log(plan.describe())
    return resolved, plan


def refuse_what_cannot_fit(path: Path, runtime: RuntimeSection) -> None:
    """Before a GGUF file is loaded, its plan from the file's header alone (its weights at the size
    they will take): a memory_budget_mb too small raises MemoryPlanError naming the sizes, and
    without a budget so does a plan larger than the memory this machine has available."""
    if (
        path.suffix != ".gguf"
        or not path.is_file()
        or not runtime.matmul_kernel
        or runtime.dtype != "float32"
    ):
        return
    spec, weights = gguf_file.stored_weights(path)
    _, plan = plan_memory(spec, runtime, weights)
    available = available_mb()
    if runtime.memory_budget_mb is None and plan.total_mb > available:
        raise MemoryPlanError(
            f"{path.name} does not fit: weights {plan.weights_mb:.0f} MB, KV cache {plan.kv_mb:.0f} MB, "
            f"working {plan.working_mb:.0f} MB: {plan.total_mb:.0f} MB, and this machine has "
            f"{available:.0f} MB available; lower num_slots or max_seq_len, or set memory_budget_mb"
        )


def check_peak(plan: MemoryPlan, allocated_bytes: int, reserved_bytes: int | None = None) -> str | None:
    """Why an agent must not start when MindSpore's pool peaked at `allocated_bytes` during warm-up
    (mindspore.runtime.max_memory_allocated; `reserved_bytes`: max_memory_reserved, named in the
    message) over what the plan gives the pool (pooled_mb), with the numbers; None when under.
    Warm-up runs every graph at its largest shape, so serving asks no more of the pool than that."""
    allocated = allocated_bytes / MB
    if allocated <= plan.pooled_mb:
        return None
    over = allocated - plan.pooled_mb
    fewer = plan.num_blocks - int(-(-over // plan.block_mb))
    reserved = "" if reserved_bytes is None else f" ({reserved_bytes / MB:.0f} MB reserved)"
    outside = plan.total_mb - plan.pooled_mb
    parts = ", ".join(
        [
            f"weights {plan.weights_mb:.0f} MB",
            f"KV cache {plan.kv_mb:.0f} MB",
            f"working {plan.working_mb:.0f} MB",
            *(f"{reserve.name} {reserve.mb:.0f} MB" for reserve in plan.reserves if reserve.pooled),
        ]
    )
    return (
        f"device memory: MindSpore's pool peaked at {allocated:.0f} MB allocated{reserved} during "
        f"warm-up, {over:.0f} MB over the {plan.pooled_mb:.0f} MB the memory plan gives it ({parts}"
        + (f"; {outside:.0f} MB of HCCL buffers outside the pool" if outside else "")
        + f"): the plan's reserves are too small for this model here; set runtime.num_blocks to at "
        f"most {fewer} (the plan's {plan.num_blocks} less {over:.0f} MB of blocks) or lower "
        "prefill_buckets, and report the numbers"
    )
