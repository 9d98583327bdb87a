"""Qwen3 (and the DeepSeek-R1 distills on it): Llama's layout with QK-norm (each query and key head
RMS-normed before RoPE, one weight [head_dim] per layer for each) and a head size of its own (128
beside a hidden size that is not 128 x heads), no QKV bias; Q/K rows unpermuted in GGUF files."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from agent.model.families import llama
from agent.model.families.base import Family, GgufLayout, HfLayout, Meta


def gguf_spec_fields(path: Path, meta: Meta, hidden: int, head_dim: int, layers: int) -> dict[str, Any]:
    return {"qk_norm": True}


def hf_spec_fields(config: dict[str, Any]) -> dict[str, Any]:
    return {"qk_norm": True}


FAMILY = Family(
    "qwen3",
    gguf=GgufLayout(
        "qwen3",
        llama.GGUF_LAYER_NAMES | {"attn_q_norm.weight": "q_norm", "attn_k_norm.weight": "k_norm"},
        llama.GGUF_GLOBAL_NAMES,
        spec_fields=gguf_spec_fields,
    ),
    hf=HfLayout(
        "qwen3",
        llama.HF_LAYER_NAMES | {"self_attn.q_norm.weight": "q_norm", "self_attn.k_norm.weight": "k_norm"},
        llama.HF_GLOBAL_NAMES,
        spec_fields=hf_spec_fields,
    ),
)
