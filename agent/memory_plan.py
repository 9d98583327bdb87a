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
    rings     sliding-window layers (Gemma 3's local layers): (num_slots + 1) seats' rings of
              ceil((window - 1 + the largest prefill bucket) / block_size) blocks each, whatever
              the sequences' lengths (agent/graphs/interface.py)
    working   prefill attention scores of every layer at the largest prefill bucket (fp32),
              logits of the largest decode batch, the RoPE tables (cos and sin of every
              position: 134 MB for Gemma 3's two bases over its 32768 positions), and on the
              gather decode path one layer's K and V gathered for the largest decode batch over
              max_seq_len positions
    total     weights + pool x KV block + working
    ranks     tensor parallelism: every figure of one rank's share (rank_spec), the pool as large on
              every rank

Seats (num_slots: sequences placed at once) cost no KV: their sequences take blocks as they grow,
so a pool smaller than every seat's whole length serves many short sequences and a few long ones.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from agent.graphs.cache_format import VALUE_BYTES, CacheFormat
from agent.graphs.interface import local_ring_blocks, scratch_blocks
from agent.launcher.memory_budget import available_mb
from agent.model.checkpoint import Checkpoint
from agent.model.formats import gguf_file
from agent.model.spec import ModelSpec
from config.schema import RuntimeSection

MB = 1 << 20
LENGTH_STEP = 256  # a planned max_seq_len is a multiple of this


class MemoryPlanError(ValueError):
    """The budget cannot hold the model with at least one slot; the message says what to change."""


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
    rings_mb: float = 0.0  # the sliding-window layers' rings, every seat's
    kv_format: str = "float32"  # the cache's rows (agent/graphs/cache_format.py)

    @property
    def kv_mb(self) -> float:
        return (self.num_blocks + self.scratch_blocks) * self.block_mb + self.rings_mb

    @property
    def total_mb(self) -> float:
        return self.weights_mb + self.kv_mb + self.working_mb

    def describe(self) -> str:
        budget = f" of a {self.budget_mb} MB budget" if self.budget_mb else ""
        positions = self.num_blocks * self.block_size
        return (
            f"memory plan: weights {self.weights_mb:.0f} MB, KV cache {self.kv_mb:.0f} MB"
            + (f" ({self.kv_format})" if self.kv_format == "q8_0" else "")
            + f": {self.num_blocks} blocks of {self.block_size} positions ({positions} positions, "
            f"{positions / self.max_seq_len:.1f} sequences of max_seq_len {self.max_seq_len}) "
            f"shared by {self.num_slots} seats"
            + (
                f" (global layers; sliding-window layers' rings {self.rings_mb:.0f} MB)"
                if self.rings_mb
                else ""
            )
            + f", working {self.working_mb:.0f} MB: "
            f"{self.total_mb:.0f} MB{budget}"
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
    longest = runtime.prefill_buckets[-1]
    scores = spec.num_layers * spec.num_heads * longest * longest * 4
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
    return scores + runtime.decode_batch_buckets[-1] * spec.vocab_size * 4 * 2 + rope + gather


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
    """num_blocks as set, else all the budget's `room`, else (no budget) each seat its whole length."""
    if runtime.num_blocks != "auto":
        return runtime.num_blocks
    if room is not None:
        return room
    return slots * -(-max_len // runtime.block_size)


def plan_memory(
    spec: ModelSpec, runtime: RuntimeSection, weights: int | None = None
) -> tuple[RuntimeSection, MemoryPlan]:
    """The runtime with num_slots, max_seq_len and num_blocks resolved, and the plan; `weights`: the
    weights' bytes (checkpoint_weights_bytes), else estimated from the spec. Raises MemoryPlanError
    when the budget is too small, naming the sizes."""
    weights = weights_bytes(spec, runtime) if weights is None else weights
    working = working_bytes(spec, runtime)
    slots = runtime.decode_batch_buckets[-1] if runtime.num_slots == "auto" else runtime.num_slots
    # Sliding-window layers keep per-seat rings (unless a ring would hold a whole sequence)
    longest = spec.max_context if runtime.max_seq_len == "auto" else runtime.max_seq_len
    ring = local_ring_blocks(runtime, spec, longest)
    pool_layers = spec.global_layers if ring else spec.num_layers
    position_bytes = 2 * spec.num_kv_heads * CacheFormat.of(runtime).row_bytes(spec.head_dim)
    per_block = pool_layers * position_bytes * runtime.block_size
    rings = (slots + 1) * ring * (spec.num_layers - pool_layers) * position_bytes * runtime.block_size
    scratch = scratch_blocks(runtime)
    budget = None if runtime.memory_budget_mb is None else runtime.memory_budget_mb * MB
    # blocks the budget leaves for the pool (None: no budget)
    room = None if budget is None else (budget - weights - working - rings) // per_block - scratch
    if room is not None and room <= 0:
        raise MemoryPlanError(
            f"memory_budget_mb {runtime.memory_budget_mb} does not hold the weights "
            f"({weights / MB:.0f} MB), working memory ({working / MB:.0f} MB)"
            + (f", the sliding-window layers' rings ({rings / MB:.0f} MB)" if rings else "")
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
                f"working memory ({working / MB:.0f} MB))"
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
        CacheFormat.of(runtime).name,
    )
    return resolved, plan


def resolve_runtime(
    spec: ModelSpec, runtime: RuntimeSection, log: Callable[[str], None], weights: int | None = None
) -> RuntimeSection:
    """plan_memory, with the plan logged: what every process that builds a runner calls first."""
    resolved, plan = plan_memory(spec, runtime, weights)
    log(plan.describe())
    return resolved


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
