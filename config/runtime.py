"""How each agent builds and runs its graphs: shapes, KV blocks and slots, kernels, MindSpore's
context, speculative decoding."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field, field_validator, model_validator

from config.base import Section, resolve_path


def _bucket_list(values: list[int], name: str) -> list[int]:
    if not values:
        raise ValueError(f"{name} must not be empty")
    if any(v <= 0 for v in values):
        raise ValueError(f"{name} must be positive, got {values}")
    return sorted(set(values))


def _clipped(buckets: list[int], limit: int) -> list[int]:
    """Default buckets for a sequence length of `limit`: those below it, then `limit` itself."""
    return sorted({b for b in buckets if b < limit} | {limit})


_UNPLANNED = (
    'runtime.{field} is still "auto": plan the runtime first '
    "(agent.memory_plan.resolve_runtime resolves it from memory_budget_mb)"
)


class SpeculationSection(Section):
    """Speculative decoding: tokens proposed for a decoding sequence are verified together in one
    step (the target's answers stay exactly its own), a win while a step is bound by reading the
    weights (few streams) and the proposals are often right (answers that copy from the prompt)."""

    method: Literal["none", "ngram", "draft"] = Field(
        "ngram",
        description="ngram (the default): propose what followed the latest earlier occurrence of "
        "the sequence's last n tokens in its prompt and answer (prompt lookup), as many as pay for "
        "themselves by the sequence's acceptance and the learned step costs; draft: the greedy "
        "tokens of draft_model, a smaller model with the same vocabulary run by each agent beside "
        "the model; none: off",
    )
    draft_model: Path | None = Field(
        None, description="method draft: the draft model's file or folder (any format the agents load)"
    )
    num_tokens: int = Field(
        4, ge=1, le=16, description="the most tokens proposed for a sequence in one step (draft: the count)"
    )
    ngram_min: int = Field(2, ge=1, le=8, description="the shortest n-gram matched")
    ngram_max: int = Field(4, ge=1, le=8, description="the longest n-gram matched (tried first)")
    adaptive: bool = Field(
        True,
        description="ngram: each step's proposal lengths chosen so they pay for themselves "
        "(scheduler/speculation/proposal_length.py); false: num_tokens each (as many as the lookup finds), "
        "whatever they cost: for tests and measurements of the verification itself",
    )
    max_batch: int | None = Field(
        None,
        ge=1,
        description="sequences decoding in a group beyond which nothing is proposed; unset: no "
        "such bound for ngram (proposals stop by themselves where they cost more than they earn), "
        "4 for draft (whose own cost is not modelled)",
    )

    @field_validator("draft_model")
    @classmethod
    def _absolute(cls, path: Path | None) -> Path | None:
        return None if path is None else resolve_path(path)

    @model_validator(mode="after")
    def _consistent(self) -> SpeculationSection:
        if self.ngram_min > self.ngram_max:
            raise ValueError(f"ngram_min ({self.ngram_min}) exceeds ngram_max ({self.ngram_max})")
        if (self.method == "draft") != (self.draft_model is not None):
            raise ValueError("method draft needs draft_model, and draft_model needs method draft")
        return self


class KVTiersSection(Section):
    """The prefix cache's second tier (agent/kv_tiers.py): blocks the KV pool evicts kept in host
    memory, then in files that survive a restart, and read back on a hit instead of recomputed.
    Off unless a bound is set."""

    host_mb: int = Field(
        0, ge=0, le=1 << 20, description="host memory for evicted blocks per agent, MB; 0: no host tier"
    )
    disk_mb: int = Field(
        0, ge=0, le=1 << 24, description="disk for evicted blocks per agent, MB; 0: no disk tier"
    )
    disk_dir: Path = Field(
        Path("output/kv_tiers"),
        validate_default=True,  # the default is resolved against the project root too
        description="the disk tier's folder (a subfolder per arithmetic and per model's weights)",
    )

    @field_validator("disk_dir")
    @classmethod
    def _dir_absolute(cls, path: Path) -> Path:
        return resolve_path(path)

    @property
    def enabled(self) -> bool:
        return bool(self.host_mb or self.disk_mb)


class RuntimeSection(Section):
    """How each agent builds and runs its graphs (shapes, KV slots, MindSpore context)."""

    @property
    def attention_kernel(self) -> bool:
        """Decode attention by the custom CPU kernel (reads each sequence's own positions from the
        cache) rather than gather + batched matmuls over an attend bucket."""
        return self.decode_attention == "kernel" or (
            self.decode_attention == "auto" and self.device_target == "CPU"
        )

    @property
    def paged_attention(self) -> bool:
        """Attention by the paged backend (agent/graphs/paged_attention.py): the Ascend kernels
        ReshapeAndCache and PagedAttention on Ascend, their reference in MindSpore's ops elsewhere."""
        return self.decode_attention == "paged" or (
            self.decode_attention == "auto" and self.device_target == "Ascend"
        )

    @property
    def jit_config(self) -> dict[str, str]:
        """MindSpore's jit_config the agents set ({}: MindSpore's own, on CPU with jit_level auto).
        On Ascend with the paged backend also infer_boost on: MindSpore's internal kernels, the only
        PagedAttention and ReshapeAndCache it has for 910B, are selected for inference graphs only
        (MsContext::IsEnableInferBoost reads jit_config's infer_boost; the step graphs' predict phase,
        agent/graphs/step_graphs.py PagedStepGraph, is the other half), as vllm-mindspore sets it."""
        device = self.device_target != "CPU"
        level = "O0" if self.jit_level == "auto" and device else self.jit_level
        config: dict[str, str] = {} if level == "auto" else {"jit_level": level}
        if self.paged_attention and self.device_target == "Ascend":
            config["infer_boost"] = "on"
        return config

    @property
    def matmul_kernel(self) -> bool:
        """The layers' matmuls by the custom CPU kernel (packed weights, skinny products) rather
        than MindSpore's MatMul."""
        return self.matmul == "kernel" or (self.matmul == "auto" and self.device_target == "CPU")

    device_target: Literal["CPU", "Ascend", "GPU"] = "CPU"
    dtype: Literal["float32", "float16", "bfloat16"] = Field(
        "float32",
        description="weights, activations and KV cache; half types on Ascend/GPU (float16 "
        "also on CPU with matmul: mindspore and decode_attention: gather)",
    )
    cpu_threads: int | None = Field(None, ge=1, description="MindSpore CPU op threads; None: its default")
    jit_level: Literal["auto", "O0", "O1", "O2"] = Field(
        "auto",
        description="MindSpore's graph compile level (jit_config); auto: O0 (kernel by kernel, as "
        "vllm-mindspore and MindFormers run inference) on Ascend and GPU, MindSpore's own on CPU",
    )
    num_slots: Annotated[int, Field(ge=1)] | Literal["auto"] = Field(
        16,
        description="most sequences placed at once (each a slot with its sampling state; their "
        "KV comes from the block pool, so free blocks bound them too); auto: the largest decode "
        "batch bucket",
    )
    max_seq_len: Annotated[int, Field(ge=2)] | Literal["auto"] = Field(
        2048,
        description="positions of one sequence: prompt + generated tokens; auto: the model's "
        "context length, shortened to what memory_budget_mb holds",
    )
    num_blocks: Annotated[int, Field(ge=1)] | Literal["auto"] = Field(
        "auto",
        description="KV-cache blocks shared by every sequence; auto: what memory_budget_mb leaves "
        "after weights and working memory, or without a budget num_slots x ceil(max_seq_len / "
        "block_size) (each slot its whole length)",
    )
    memory_budget_mb: int | None = Field(
        None,
        ge=1,
        description="device memory for weights + KV cache + working memory per agent; "
        "the agent plans num_blocks (and num_slots/max_seq_len auto) from it and logs the plan",
    )
    block_size: int = Field(
        16,
        description="positions per KV-cache block (a power of two, 1..256): the cache is paged in "
        "blocks, each sequence reads its positions through a table of its blocks",
    )
    # The largest prefill bucket is the most positions one prefill call computes: a longer prompt
    # runs in chunks (fused layers), else it is the longest prompt accepted. Prefill memory grows
    # with its square (the attention scores of all layers stay allocated).
    prefill_buckets: list[int] = Field(default_factory=lambda: [32, 64, 128, 512])
    decode_batch_buckets: list[int] = Field(default_factory=lambda: [1, 4, 8, 16])
    attend_buckets: list[int] = Field(
        default_factory=lambda: [256, 512, 2048], description="attended lengths of the gather decode path"
    )
    decode_attention: Literal["auto", "kernel", "gather", "paged"] = Field(
        "auto",
        description="auto: the custom kernel on CPU, paged on Ascend (ReshapeAndCache and "
        "PagedAttention; elsewhere paged is their reference in MindSpore's ops), gather on GPU",
    )
    matmul: Literal["auto", "kernel", "mindspore"] = Field(
        "auto", description="the layers' matmuls: auto: the custom kernel on CPU, MindSpore's elsewhere"
    )
    # Speed by default where it is llama.cpp's own arithmetic (the README's "int8 activations").
    activations: Literal["auto", "float32", "int8"] = Field(
        "auto",
        description="the quantized GGUF layers' products: int8 (activations quantized per block of "
        "32 as llama.cpp does: prompts ~2x faster, decode steps faster, answers may differ; needs "
        "AVX2 or AVX512-VNNI), float32 (exact), or auto: int8 for a quantized GGUF on the CPU "
        "kernels with integer dot products, float32 elsewhere (agent/activations.py)",
    )
    kv_cache_dtype: Literal["auto", "q8_0"] = Field(
        "auto",
        description="the KV cache's rows: auto (in dtype) or q8_0 (llama.cpp's -ctk/-ctv q8_0: blocks "
        "of 32 values as int8 with a half scale, 34 bytes for 128 of float32: ~3.8x the positions "
        "for the same memory; written and read by the fused CPU layer kernel, so it needs "
        "matmul and decode_attention auto or kernel on CPU, float32, no tensor parallelism)",
    )
    compile_cache_dir: Path | None = Field(
        Path("output/compile_cache"), description="MindSpore compile cache; null disables it"
    )
    speculation: SpeculationSection = Field(default_factory=SpeculationSection)
    kv_tiers: KVTiersSection = Field(default_factory=KVTiersSection)
    state_snapshots: int = Field(
        8,
        ge=0,
        le=4096,
        description="models with Gated DeltaNet layers (Qwen3.5): prompts' states kept for prefix-cache "
        "hits (each a whole state beside the KV blocks; a hit resumes from the longest prefix whose state "
        "is kept); 0: no prefix caching for them; other models: unused",
    )

    @field_validator("prefill_buckets", "decode_batch_buckets", "attend_buckets")
    @classmethod
    def _buckets(cls, values: list[int], info) -> list[int]:
        return _bucket_list(values, info.field_name)

    @field_validator("block_size")
    @classmethod
    def _block_size(cls, value: int) -> int:
        if not 1 <= value <= 256 or value & (value - 1):
            raise ValueError(f"block_size must be a power of two from 1 to 256, got {value}")
        return value

    @field_validator("compile_cache_dir")
    @classmethod
    def _cache_absolute(cls, path: Path | None) -> Path | None:
        return None if path is None else resolve_path(path)

    @property
    def planned(self) -> bool:
        """num_slots, max_seq_len and num_blocks are numbers (agent.memory_plan resolves "auto")."""
        seats_and_length = self.num_slots != "auto" and self.max_seq_len != "auto"
        return seats_and_length and (self.num_blocks != "auto" or self.memory_budget_mb is None)

    @property
    def planned_num_blocks(self) -> int:
        """num_blocks once planned: the KV pool's blocks (the scratch blocks beyond them)."""
        if self.num_blocks != "auto":
            return self.num_blocks
        if self.memory_budget_mb is not None or self.num_slots == "auto" or self.max_seq_len == "auto":
            raise ValueError(_UNPLANNED.format(field="num_blocks"))
        return self.num_slots * -(-self.max_seq_len // self.block_size)  # each slot its whole length

    @property
    def planned_num_slots(self) -> int:
        """num_slots once planned: what everything that builds or runs graphs reads."""
        if self.num_slots == "auto":
            raise ValueError(_UNPLANNED.format(field="num_slots"))
        return self.num_slots

    @property
    def planned_max_seq_len(self) -> int:
        """max_seq_len once planned: what everything that builds or runs graphs reads."""
        if self.max_seq_len == "auto":
            raise ValueError(_UNPLANNED.format(field="max_seq_len"))
        return self.max_seq_len

    @model_validator(mode="after")
    def _kernels_fit_device(self) -> RuntimeSection:
        """The kernels, activations, KV cache dtype and model dtype the device target can run."""
        if self.decode_attention == "kernel" and self.device_target != "CPU":
            raise ValueError(f"decode_attention: kernel is a CPU kernel; use gather on {self.device_target}")
        if self.matmul == "kernel" and self.device_target != "CPU":
            raise ValueError(f"matmul: kernel is a CPU kernel; use mindspore on {self.device_target}")
        if self.paged_attention and self.jit_level in ("O1", "O2"):
            raise ValueError(
                f"jit_level {self.jit_level} with paged attention: MindSpore runs PagedAttention and "
                "ReshapeAndCache as its internal inference kernels, which only the kernel-by-kernel "
                "level O0 selects (as vllm-mindspore and MindFormers' predict mode require); use "
                "jit_level O0 or auto"
            )
        if self.activations == "int8" and not (self.attention_kernel and self.matmul_kernel):
            raise ValueError(
                "activations: int8 runs in the fused CPU layer kernel: it needs device_target CPU "
                "with matmul and decode_attention auto or kernel"
            )
        if self.kv_cache_dtype == "q8_0" and not (
            self.attention_kernel and self.matmul_kernel and self.dtype == "float32"
        ):
            raise ValueError(
                "kv_cache_dtype: q8_0 is written and read by the fused CPU layer kernel: it needs "
                "device_target CPU, dtype float32, and matmul and decode_attention auto or kernel"
            )
        if self.device_target == "CPU" and self.dtype == "bfloat16":
            raise ValueError("dtype bfloat16 has no MindSpore CPU kernels; use float32 (or float16)")
        if (
            self.device_target == "CPU"
            and self.dtype == "float16"
            and (self.attention_kernel or self.matmul_kernel)
        ):
            raise ValueError(
                "dtype float16 on CPU needs matmul: mindspore and decode_attention: gather "
                "(the custom CPU kernels compute in float32)"
            )
        return self

    @model_validator(mode="after")  # after _kernels_fit_device: pydantic runs them in this order
    def _buckets_cover_limits(self) -> RuntimeSection:
        if not self.planned:
            if self.memory_budget_mb is None and "auto" in (self.num_slots, self.max_seq_len):
                raise ValueError("num_slots/max_seq_len auto need memory_budget_mb")
            return self  # checked again once planned
        max_seq_len, num_slots = self.planned_max_seq_len, self.planned_num_slots
        if self.planned_num_blocks * self.block_size < max_seq_len:
            raise ValueError(
                f"num_blocks {self.planned_num_blocks} of {self.block_size} positions do not hold one "
                f"sequence of max_seq_len {max_seq_len}"
            )
        # Buckets left at their defaults follow the user's max_seq_len (those below it, then it);
        # buckets the user wrote are checked as written.
        if "attend_buckets" not in self.model_fields_set:
            self.attend_buckets = _clipped(self.attend_buckets, max_seq_len)
        if "prefill_buckets" not in self.model_fields_set and self.prefill_buckets[-1] > max_seq_len:
            self.prefill_buckets = _clipped(self.prefill_buckets, max_seq_len)
        if self.attend_buckets[-1] != max_seq_len:
            raise ValueError(
                f"the largest of attend_buckets must equal max_seq_len "
                f"({self.max_seq_len}), got {self.attend_buckets} (leave attend_buckets out to "
                "take the default buckets up to max_seq_len)"
            )
        if self.prefill_buckets[-1] > max_seq_len:
            raise ValueError(
                f"prefill_buckets may not exceed max_seq_len ({self.max_seq_len}), got {self.prefill_buckets}"
            )
        if self.decode_batch_buckets[-1] < num_slots:
            raise ValueError(
                f"the largest of decode_batch_buckets must be at least num_slots "
                f"({self.num_slots}), got {self.decode_batch_buckets}"
            )
        return self
