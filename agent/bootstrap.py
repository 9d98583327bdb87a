"""From a config to a ModelRunner whose graphs passed the known-answer check: what the agent process
and the tools that run the model in-process (generate, model_bench, export) all do, in this order:

    init_device: MindSpore's context on the device (device, memory cap, compile level, threads),
                 then the tensor-parallel cluster joined when the model is split (init(): HCCL on
                 Ascend), before the weights load: a rank's slow load never counts against
                 the cluster's connect timeout
    -> weights (a checkpoint, or an export's MindIR files)
    -> runtime (the memory plan resolves num_slots / max_seq_len / num_blocks "auto")
    -> the compile cache, keyed by the weights and the plan (agent/compile_cache.py)
    -> ModelRunner
    -> warm-up, every graph checked against a numpy forward of the weights (agent/known_answer.py)

The process's entry calls agent.process_env.set_process_defaults() before importing this module,
and init_device() once before build_runner() or prepare_checkpoint().
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import mindspore as ms

from agent.activations import exact, resolve_activations
from agent.compile_cache import compile_cache_dir, use_compile_cache
from agent.drafter import Drafter, DraftMismatch, check_vocabularies
from agent.graphs.layers import WHOLE_MODEL, TensorSplit
from agent.graphs.mindir import read_known_answer, read_spec
from agent.known_answer import TOLERANCE, Int8AllowanceError, KnownAnswer, KnownAnswerError
from agent.memory_plan import (
    MemoryPlan,
    MemoryPlanError,
    check_peak,
    checkpoint_weights_bytes,
    rank_spec,
    refuse_what_cannot_fit,
    resolve_runtime,
    weights_bytes,
)
from agent.model.checkpoint import Checkpoint
from agent.model.formats import load_checkpoint
from agent.model.spec import ModelSpec
from agent.runner import ModelRunner, configure_mindspore
from agent.warm_up import warm_up
from config.schema import RuntimeSection, ServingConfig

log = logging.getLogger(__name__)
Progress = Callable[[str], None]


@dataclass(frozen=True)
class Placement:
    """Where one runner runs: its device, its share of a tensor-parallel group, its role, its group's
    own slot count (none: runtime.num_slots) and its compile cache folder's name (none: no cache)."""

    cache_user: str | None
    device_id: int = 0
    split: TensorSplit = TensorSplit()
    role: str = "mixed"
    num_slots: int | None = None

    @classmethod
    def of_agent(cls, config: ServingConfig, rank: int) -> Placement:
        agents, group = config.agents, config.agents.group(rank)
        split = TensorSplit(agents.rank_in_group[rank], group.tensor_parallel)
        return cls(
            cache_user=f"rank_{rank}" + (f"_tp{split.rank}of{split.size}" if split.size > 1 else ""),
            device_id=agents.device_id(rank),
            split=split,
            role=agents.roles[rank],
            num_slots=group.num_slots,
        )

    def runtime(self, configured: RuntimeSection) -> RuntimeSection:
        if self.num_slots is None:
            return configured
        return configured.model_copy(update={"num_slots": self.num_slots})


def init_device(config: ServingConfig, place: Placement, progress: Progress = log.info) -> None:
    """The process's MindSpore context on `place`'s device (configure_mindspore: once a process)
    and, for a tensor-parallel share, its group's cluster joined: before any weights load."""
    configure_mindspore(place.runtime(config.runtime), place.device_id)
    if place.split.size > 1:
        _join_cluster(place.split, progress)


def build_runner(
    config: ServingConfig,
    place: Placement,
    progress: Progress = log.info,
    checkpoint: Checkpoint | None = None,
) -> tuple[ModelRunner, float]:
    """The runner of `config` at `place` (from `checkpoint` when already loaded), warmed up and
    checked, and the warm-up's seconds; after init_device(). A graph that disagrees with the
    weights raises KnownAnswerError saying what to do."""
    if config.model.uses_mindir:
        runner, known, plan = _mindir_runner(config, place, progress)
        remedy = f"the MindIR files of {config.model.path} do not fit their own manifest: export them again"
    else:
        runner, known, plan, cache = _checkpoint_runner(config, place, progress, checkpoint)
        remedy = (
            f"the compile cache {cache.parent} holds graphs that do not fit this model: delete that "
            f"folder and start again (if this persists with an empty cache, it is a bug: report it)"
            if cache is not None
            else "no cache was used: this is a bug, please report it"
        )
    progress(
        f"KV cache: {runner.num_blocks} blocks of {runner.runtime.block_size} positions shared by "
        f"{runner.num_slots} slots (max_seq_len {runner.max_len}), {runner.graphs.cache_bytes() / 1e6:.0f} MB"
    )
    try:
        seconds = warm_up(runner, progress, place.role, known)
        check_device_peak(runner.runtime, plan)
        return runner, seconds
    except Int8AllowanceError as exc:
        if config.runtime.activations == "auto":  # auto's choice did not hold for these weights: say so
            progress(
                f"{exc}: int8 activations move this model's logits past their allowance "
                f"({TOLERANCE['int8']:.0%} of the largest); building it again with float32 activations "
                "(set runtime.activations: float32 to start that way)"
            )
            del runner
            return build_runner(exact(config), place, progress, checkpoint)
        raise KnownAnswerError(
            f"{exc}; runtime.activations int8 moves this model's logits more than the int8 allowance "
            f"({TOLERANCE['int8']:.0%} of the largest): serve it with activations: float32, or report "
            "it if float32 fails too"
        ) from exc
    except KnownAnswerError as exc:
        raise KnownAnswerError(f"{exc}; {remedy}") from exc


def check_device_peak(runtime: RuntimeSection, plan: MemoryPlan) -> None:
    """After warm-up (every graph at its largest shape) on a device: MindSpore's pool peak against
    the plan, MemoryPlanError with the numbers when over it. CPU's pool keeps no statistics."""
    if runtime.device_target == "CPU":
        return
    refusal = check_peak(plan, ms.runtime.max_memory_allocated(), ms.runtime.max_memory_reserved())
    if refusal is not None:
        raise MemoryPlanError(refusal)


def build_drafter(
    config: ServingConfig, runner: ModelRunner, progress: Progress = log.info
) -> Drafter | None:
    """The draft model of runtime.speculation method draft (None for other methods), beside
    `runner` with the same runtime: its vocabulary checked against the model's (DraftMismatch),
    its graphs warmed up and checked against a numpy forward of its weights."""
    speculation = config.runtime.speculation
    if speculation.method != "draft" or speculation.draft_model is None:
        return None
    check_vocabularies(config.model.path, speculation.draft_model)
    start = time.perf_counter()
    checkpoint = load_checkpoint(speculation.draft_model)
    progress(
        f"draft model {speculation.draft_model.name} loaded in {time.perf_counter() - start:.1f}s "
        f"({checkpoint.format}, {checkpoint.spec.parameter_count() / 1e6:.1f}M parameters)"
    )
    if checkpoint.spec.linear_attention is not None:  # its rejected proposals would stay in its state
        raise DraftMismatch(
            f"runtime.speculation.draft_model {speculation.draft_model}: a draft model with Gated DeltaNet "
            "layers is not supported (its state cannot take back the proposals the model rejects); use a "
            "draft model with attention only, or method ngram"
        )
    if checkpoint.spec.vocab_size != runner.spec.vocab_size:
        raise DraftMismatch(
            f"runtime.speculation.draft_model {speculation.draft_model}: {checkpoint.spec.vocab_size} "
            f"logits a position, the model's {runner.spec.vocab_size}"
        )
    # the draft's own weights decide its activations (a float draft beside a quantized model)
    configured = runner.runtime.model_copy(update={"activations": config.runtime.activations})

    def draft_progress(line: str) -> None:
        progress(f"draft model: {line}")

    runtime = resolve_activations(checkpoint, configured, WHOLE_MODEL, draft_progress)
    draft = ModelRunner.from_checkpoint(checkpoint, runtime)
    warm_up(draft, draft_progress, "draft", KnownAnswer.of_checkpoint(checkpoint, runtime))
    return Drafter(draft, runner)


def prepare_checkpoint(
    config: ServingConfig, place: Placement, progress: Progress, checkpoint: Checkpoint | None = None
) -> tuple[Checkpoint, RuntimeSection, MemoryPlan, Path | None]:
    """The weights (loaded unless given), the planned runtime, its memory plan and the compile cache
    (its folder returned): what every runner built from a checkpoint needs, after init_device()."""
    if checkpoint is None:
        refuse_what_cannot_fit(Path(config.model.path), place.runtime(config.runtime))
        start = time.perf_counter()
        checkpoint = load_checkpoint(config.model.path, split=place.split, dtype=config.runtime.dtype)
        share = (
            "" if place.split.size == 1 else f", this rank's share {checkpoint.weight_bytes() / 1e6:.0f} MB"
        )
        progress(
            f"weights loaded in {time.perf_counter() - start:.1f}s ({checkpoint.format}, "
            f"{checkpoint.spec.parameter_count() / 1e6:.1f}M parameters{share})"
        )
    runtime = place.runtime(config.runtime)
    if place.split.size == 1:
        weights, spec = checkpoint_weights_bytes(checkpoint, runtime), checkpoint.spec
    else:  # each rank's device holds its share of the layers (and KV heads)
        spec = rank_spec(checkpoint.spec, place.split.size)
        weights = weights_bytes(spec, runtime)
    runtime, plan = resolve_runtime(spec, runtime, progress, weights, ranks=place.split.size)
    runtime = resolve_activations(checkpoint, runtime, place.split, progress)
    cache = None if place.cache_user is None else compile_cache_dir(checkpoint, runtime, place.cache_user)
    if cache is not None:
        use_compile_cache(cache)
    return checkpoint, runtime, plan, cache


def _checkpoint_runner(
    config: ServingConfig, place: Placement, progress: Progress, checkpoint: Checkpoint | None
) -> tuple[ModelRunner, KnownAnswer, MemoryPlan, Path | None]:
    checkpoint, runtime, plan, cache = prepare_checkpoint(config, place, progress, checkpoint)
    refuse_unsupported_state(checkpoint.spec, runtime)
    if place.split.size > 1:
        _describe_share(place.split, checkpoint.spec, progress)
    runner = ModelRunner.from_checkpoint(checkpoint, runtime, place.split)
    start = time.perf_counter()
    known = KnownAnswer.of_checkpoint(checkpoint, runtime)
    progress(f"known answer for the warm-up check computed in {time.perf_counter() - start:.2f}s")
    return runner, known, plan, cache


def refuse_unsupported_state(spec: ModelSpec, runtime: RuntimeSection) -> None:
    """A model with Gated DeltaNet layers (Qwen3.5's) keeps a state per sequence beside its KV,
    which a KV transfer (disaggregation) moves with it but the prefix cache's second tier does not
    hold yet: such a model runs without the tier."""
    if spec.linear_attention is None:
        return
    if runtime.kv_tiers.enabled:
        raise ValueError(
            f"{spec.architecture}: runtime.kv_tiers keeps K/V blocks alone, and this model's Gated "
            "DeltaNet layers keep a state per sequence the tier does not hold yet: turn the tier off "
            "(host_mb: 0, disk_mb: 0)"
        )


def _mindir_runner(
    config: ServingConfig, place: Placement, progress: Progress
) -> tuple[ModelRunner, KnownAnswer, MemoryPlan]:
    start = time.perf_counter()
    runtime, plan = resolve_runtime(read_spec(config.model), place.runtime(config.runtime), progress)
    runner = ModelRunner.from_mindir(config.model, runtime)
    progress(
        f"MindIR graphs loaded in {time.perf_counter() - start:.1f}s "
        f"({runner.spec.parameter_count() / 1e6:.1f}M parameters)"
    )
    return runner, read_known_answer(config.model), plan


def _join_cluster(split: TensorSplit, progress: Progress) -> None:
    """Tensor parallelism: join the group's MindSpore cluster (the launcher set MS_ROLE=MS_WORKER,
    MS_NODE_ID and the scheduler's address); its collectives then run inside the graphs."""
    from mindspore.communication import get_group_size, get_rank, init

    progress(
        f"joining the tensor-parallel cluster as rank {split.rank} of {split.size} (scheduler "
        f"{os.environ.get('MS_SCHED_HOST')}:{os.environ.get('MS_SCHED_PORT')})"
    )
    init()
    if (get_rank(), get_group_size()) != (split.rank, split.size):
        raise RuntimeError(
            f"the cluster made this agent rank {get_rank()} of {get_group_size()}, "
            f"the config rank {split.rank} of {split.size}"
        )


def _describe_share(split: TensorSplit, spec: ModelSpec, progress: Progress) -> None:
    """A tensor-parallel rank's share of the loaded model, checked and logged."""
    if spec.num_kv_heads < split.size:
        raise RuntimeError(f"{spec.num_kv_heads} KV heads cannot be split over {split.size} agents")
    start, end = split.share(spec.num_kv_heads)
    experts = f", each expert's rows {split.share(spec.expert_intermediate_size)}" if spec.num_experts else ""
    progress(
        f"tensor-parallel rank {split.rank} of {split.size}: KV heads {start}..{end - 1}, "
        f"FFN columns {split.share(spec.intermediate_size)}{experts}"
    )
