"""SmolLM3: Llama's layout in which every fourth layer rotates nothing (NoPE: its attention sees no
positions, the others RoPE), tied embeddings. llama.cpp's smollm3 files carry no key for it: its
graph leaves layer i unrotated where (i + 1) % 4 == 0, as the model's config (no_rope_layers, one
flag a layer, 0: no RoPE) has it; Q/K rows permuted as Llama's. The NoPE layers run on the fused
CPU kernel only (agent/graphs/decoder.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from agent.model.checkpoint import CheckpointError
from agent.model.families import llama
from agent.model.families.base import Family, GgufLayout, HfLayout, Meta

NOPE_PERIOD = 4  # llama.cpp's n_no_rope_layer_step for smollm3, and the config's no_rope_layer_interval


def gguf_spec_fields(path: Path, meta: Meta, hidden: int, head_dim: int, layers: int) -> dict[str, Any]:
    return {"nope_layers": tuple(i for i in range(layers) if (i + 1) % NOPE_PERIOD == 0)}


def hf_spec_fields(config: dict[str, Any]) -> dict[str, Any]:
    """config.json's no_rope_layers (1: RoPE, 0: none), or its interval where it lists none."""
    layers = int(config["num_hidden_layers"])
    if config.get("use_sliding_window"):
        raise CheckpointError("SmolLM3 with use_sliding_window is not supported (no released model sets it)")
    flags = config.get("no_rope_layers")
    if flags is None:
        period = int(config.get("no_rope_layer_interval", NOPE_PERIOD))
        flags = [int((i + 1) % period != 0) for i in range(layers)]
    if len(flags) != layers:
        raise CheckpointError(f"no_rope_layers has {len(flags)} flags for {layers} layers")
    return {"nope_layers": tuple(i for i, rotates in enumerate(flags) if not rotates)}


FAMILY = Family(
    "smollm3",
    gguf=GgufLayout(
        "smollm3",
        llama.GGUF_LAYER_NAMES,
        llama.GGUF_GLOBAL_NAMES,
        permuted_qk=True,
        spec_fields=gguf_spec_fields,
    ),
    hf=HfLayout("smollm3", llama.HF_LAYER_NAMES, llama.HF_GLOBAL_NAMES, spec_fields=hf_spec_fields),
)
