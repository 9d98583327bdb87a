"""Phi-3 and Phi-3.5 (and Phi-4-mini's layout): Llama's layers with Q, K and V packed into one
matrix, and the FFN's gate and up into another (gate first), split by rows at load (base.PACKED);
Q/K rows unpermuted in GGUF files. Partial rotary embeddings (Phi-4-mini's 0.75) and the long-context
files' per-frequency RoPE factors (LongRoPE) are refused, not served approximately."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from agent.model.checkpoint import CheckpointError
from agent.model.families import llama, mistral
from agent.model.families.base import Family, GgufLayout, HfLayout, Meta, split_packed

GGUF_LAYER_NAMES = {
    "attn_norm.weight": "attn_norm",
    "attn_qkv.weight": "wqkv",
    "attn_output.weight": "wo",
    "ffn_norm.weight": "ffn_norm",
    "ffn_up.weight": "w_gate_up",  # llama.cpp keeps Phi-3's packed gate and up under this name
    "ffn_down.weight": "w_down",
    # a converter may also write the unpacked Q, K, V (llama.cpp reads either)
    "attn_q.weight": "wq",
    "attn_k.weight": "wk",
    "attn_v.weight": "wv",
}
HF_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm",
    "self_attn.qkv_proj.weight": "wqkv",
    "self_attn.o_proj.weight": "wo",
    "post_attention_layernorm.weight": "ffn_norm",
    "mlp.gate_up_proj.weight": "w_gate_up",
    "mlp.down_proj.weight": "w_down",
}


def hf_spec_fields(config: dict[str, Any]) -> dict[str, Any]:
    """Mistral's sliding window on every layer where config.json sets one (Phi-3-mini-4k's 2,047)."""
    rotary = float(config.get("partial_rotary_factor", 1.0))
    if rotary != 1.0:
        raise CheckpointError(f"phi3: partial_rotary_factor {rotary} is not supported (only 1.0)")
    return mistral.hf_spec_fields(config)


def gguf_spec_fields(path: Path, meta: Meta, hidden: int, head_dim: int, layers: int) -> dict[str, Any]:
    """No fields of its own; a long-context file (its rope_factors_long/short for positions past
    the original context) is refused."""
    original = meta("rope.scaling.original_context_length", None, required=False)
    if original is not None and int(original) != int(meta("context_length")):
        raise CheckpointError(
            f"{path}: LongRoPE (a context of {meta('context_length')} from {original}) is not supported"
        )
    return {}


FAMILY = Family(
    "phi3",
    gguf=GgufLayout("phi3", GGUF_LAYER_NAMES, llama.GGUF_GLOBAL_NAMES, spec_fields=gguf_spec_fields),
    hf=HfLayout(
        "phi3", HF_LAYER_NAMES, llama.HF_GLOBAL_NAMES, transform=split_packed, spec_fields=hf_spec_fields
    ),
)
