"""Memory planning: how many KV slots of how many positions an agent holds, from the model's sizes
and runtime.memory_budget_mb (or the numbers the config gives), with the plan in words for the log.

    weights   parameters x dtype size (+ the matmul kernel's packed copy of a tied lm_head,
              agent/graph_interface.py)
    KV / slot layers x 2 (K and V) x kv_heads x head_dim x dtype size x max_seq_len (rounded up to
              whole blocks of runtime.block_size positions)
    working   prefill attention scores of every layer at the largest prefill bucket (fp32),
              and logits of the largest decode batch
    total     weights + (num_slots + 1 scratch slot) x KV / slot + working
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from agent.graph_interface import packed_copy_bytes
from agent.model.spec import ModelSpec
from config.schema import RuntimeSection

MB = 1 << 20
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
LENGTH_STEP = 256  # a planned max_seq_len is a multiple of this


class MemoryPlanError(ValueError):
    """The budget cannot hold the model with at least one slot; the message says what to change."""


@dataclass(frozen=True)
class MemoryPlan:
    weights_mb: float
    kv_mb_per_slot: float
    working_mb: float
    num_slots: int
    max_seq_len: int
    budget_mb: int | None

    @property
    def total_mb(self) -> float:
        return self.weights_mb + (self.num_slots + 1) * self.kv_mb_per_slot + self.working_mb

    def describe(self) -> str:
        budget = f" of a {self.budget_mb} MB budget" if self.budget_mb else ""
        return (
            f"memory plan: weights {self.weights_mb:.0f} MB, KV {self.kv_mb_per_slot:.1f} MB per slot "
            f"of {self.max_seq_len} positions x {self.num_slots} slots (+1 scratch), working "
            f"{self.working_mb:.0f} MB: {self.total_mb:.0f} MB{budget}"
        )


def weights_bytes(spec: ModelSpec, runtime: RuntimeSection) -> int:
    return spec.parameter_count() * DTYPE_BYTES[runtime.dtype] + packed_copy_bytes(spec, runtime)


def working_bytes(spec: ModelSpec, runtime: RuntimeSection) -> int:
    longest = runtime.prefill_buckets[-1]
    scores = spec.num_layers * spec.num_heads * longest * longest * 4
    return scores + runtime.decode_batch_buckets[-1] * spec.vocab_size * 4 * 2


def _budgeted(free: int | None) -> int:
    """The bytes the budget leaves for the KV cache; "auto" sizes need a budget (the runtime's
    validation makes sure of it)."""
    if free is None:
        raise MemoryPlanError('num_slots/max_seq_len "auto" need memory_budget_mb')
    return free


def plan_memory(spec: ModelSpec, runtime: RuntimeSection) -> tuple[RuntimeSection, MemoryPlan]:
    """The runtime with num_slots and max_seq_len resolved, and the plan. Raises MemoryPlanError
    when the budget is too small, naming the sizes."""
    weights, working = weights_bytes(spec, runtime), working_bytes(spec, runtime)
    per_position = spec.kv_bytes_per_token * DTYPE_BYTES[runtime.dtype] // 4
    budget = None if runtime.memory_budget_mb is None else runtime.memory_budget_mb * MB
    free = None if budget is None else budget - weights - working
    if free is not None and free <= 0:
        raise MemoryPlanError(
            f"memory_budget_mb {runtime.memory_budget_mb} does not hold the weights "
            f"({weights / MB:.0f} MB) and working memory ({working / MB:.0f} MB)"
        )

    if runtime.max_seq_len == "auto":
        free = _budgeted(free)
        slots_wanted = 2 if runtime.num_slots == "auto" else runtime.num_slots + 1
        fitting = free // (slots_wanted * per_position) // LENGTH_STEP * LENGTH_STEP
        max_len = min(spec.max_context, fitting)
        if max_len < runtime.prefill_buckets[-1]:
            raise MemoryPlanError(
                f"memory_budget_mb {runtime.memory_budget_mb} leaves {free / MB:.0f} MB for the KV "
                f"cache: not {slots_wanted} slots of the longest prompt ({runtime.prefill_buckets[-1]} "
                f"positions); raise the budget or lower num_slots or prefill_buckets"
            )
    else:
        max_len = runtime.max_seq_len
    per_slot = per_position * -(-max_len // runtime.block_size) * runtime.block_size
    if runtime.num_slots == "auto":
        free = _budgeted(free)
        slots = min(free // per_slot - 1, runtime.decode_batch_buckets[-1])
        if slots < 1:
            raise MemoryPlanError(
                f"memory_budget_mb {runtime.memory_budget_mb} leaves {free / MB:.0f} MB for the KV "
                f"cache: not two slots (one plus the scratch slot) of {max_len} positions at "
                f"{per_slot / MB:.1f} MB each; raise the budget or lower max_seq_len"
            )
    else:
        slots = runtime.num_slots
        if free is not None and (slots + 1) * per_slot > free:
            raise MemoryPlanError(
                f"num_slots {slots} x max_seq_len {max_len} needs {(slots + 1) * per_slot / MB:.0f} MB "
                f"of KV cache (with the scratch slot), but memory_budget_mb {runtime.memory_budget_mb} "
                f"leaves {free / MB:.0f} MB after the weights ({weights / MB:.0f} MB) and working memory "
                f"({working / MB:.0f} MB); set num_slots: auto or raise the budget"
            )
    update: dict[str, int | list[int]] = {"num_slots": int(slots), "max_seq_len": int(max_len)}
    if runtime.max_seq_len == "auto":  # the attend buckets end at the planned length
        update["attend_buckets"] = sorted({b for b in runtime.attend_buckets if b < max_len} | {max_len})
    try:
        resolved = RuntimeSection.model_validate({**runtime.model_dump(), **update})
    except ValueError as exc:
        raise MemoryPlanError(f"the planned runtime ({update}) is not valid: {exc}") from exc
    plan = MemoryPlan(
        weights / MB, per_slot / MB, working / MB, int(slots), int(max_len), runtime.memory_budget_mb
    )
    return resolved, plan


def resolve_runtime(spec: ModelSpec, runtime: RuntimeSection, log: Callable[[str], None]) -> RuntimeSection:
    """plan_memory, with the plan logged: what every process that builds a runner calls first."""
    resolved, plan = plan_memory(spec, runtime)
    log(plan.describe())
    return resolved
