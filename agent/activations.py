"""What `runtime.activations: auto` (the default) becomes for one model on this machine.

int8 where the fused CPU layer kernel multiplies a quantized GGUF's layer matrices on a CPU with
integer dot products (kernels built for AVX2, AVX-VNNI or AVX512-VNNI, or for Arm's NEON, SDOT or
SMMLA): llama.cpp's own arithmetic
for such files, about twice as fast in prompts (README "int8 activations"; its quality against
float32 is measured by tools.quality). float32 everywhere else, each time saying why: float weights
gain nothing, tensor-parallel ranks and Ascend/GPU run MindSpore's ops, and a CPU without those
instructions has no int8 products. An explicit float32 or int8 is kept as it is (int8's own checks
refuse what cannot run it, agent/graphs/step_graphs.py).
"""

from __future__ import annotations

from collections.abc import Callable

from gguf import GGMLQuantizationType

from agent.kernels import TARGET_ENV, has_int8_products
from agent.kernels import target as kernel_target
from agent.model.checkpoint import Checkpoint
from agent.model.shard import TensorSplit
from config.schema import RuntimeSection, ServingConfig

# Weights the int8 activations leave float32 (int8_products.h Traits): the others are integer quants.
FLOAT_FORMATS = {GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16}


def quantized_layer_formats(checkpoint: Checkpoint) -> set[str]:
    """The integer GGUF formats of the checkpoint's layer matrices (experts' included)."""
    return {
        block.qtype.name
        for name, block in checkpoint.blocks.items()
        if name.startswith("layers.") and block.qtype not in FLOAT_FORMATS
    }


def auto_activations(checkpoint: Checkpoint, runtime: RuntimeSection, split: TensorSplit) -> tuple[str, str]:
    """(float32 or int8, why) for `activations: auto`."""
    if not (runtime.attention_kernel and runtime.matmul_kernel):
        return "float32", "the layers run MindSpore's ops here, not the fused CPU kernel"
    if split.size > 1:
        return "float32", "tensor-parallel ranks run their layers op by op"
    formats = quantized_layer_formats(checkpoint)
    if not formats:
        return "float32", "the layer matrices are float: int8 activations would gain nothing"
    if not has_int8_products():
        return "float32", (
            f"the kernels ({TARGET_ENV}={kernel_target()}) have no integer dot products (AVX2, "
            "AVX-VNNI or AVX512-VNNI on x86; NEON on Arm)"
        )
    return "int8", (
        f"{'/'.join(sorted(formats))} layer matrices on kernels with integer dot products "
        f"({TARGET_ENV}={kernel_target()})"
    )


def resolve_activations(
    checkpoint: Checkpoint, runtime: RuntimeSection, split: TensorSplit, progress: Callable[[str], None]
) -> RuntimeSection:
    """`runtime` with activations float32 or int8 (auto decided and said; set ones kept)."""
    if runtime.activations != "auto":
        return runtime
    chosen, why = auto_activations(checkpoint, runtime, split)
    exact = "" if chosen == "int8" else " (exact)"
    progress(f"activations: {chosen}{exact}, chosen by auto: {why}; set runtime.activations to choose")
    return runtime.model_copy(update={"activations": chosen})


def exact(config: ServingConfig) -> ServingConfig:
    """`config` with float32 activations, the exact mode."""
    return config.model_copy(update={"runtime": config.runtime.model_copy(update={"activations": "float32"})})
