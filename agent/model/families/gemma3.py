"""Gemma 3 (GGUF, and Hugging Face `gemma3_text` directories): Llama's layout plus QK-norm and a norm
after the attention and after the FFN (four a layer, a GGUF's weights already holding Gemma's 1 + w,
a directory's w, the 1 added at load), GeGLU, embeddings scaled by sqrt(hidden), the queries scaled
by the file's head size, and sliding-window layers with a RoPE base of their own. A directory whose
config says `use_bidirectional_attention` is an encoder (EmbeddingGemma: agent/model/families/
gemma_embedding.py says how). The shared layers run these on the fused CPU kernel only
(agent/graphs/decoder.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from agent.model.checkpoint import CheckpointError
from agent.model.families import llama
from agent.model.families.base import Family, GgufLayout, HfLayout, Meta
from agent.model.spec import ModelSpec

GGUF_LAYER_NAMES = llama.GGUF_LAYER_NAMES | {
    "attn_q_norm.weight": "q_norm",
    "attn_k_norm.weight": "k_norm",
    "post_attention_norm.weight": "post_attn_norm",
    "post_ffw_norm.weight": "post_ffn_norm",
}
# What llama.cpp's gemma3 architecture takes when the file does not say (its converter writes
# neither): a local layer's RoPE base, and every 6th layer global (layer i local unless
# (i + 1) % 6 == 0), as the model's config says (rope_local_base_freq, sliding_window_pattern).
LOCAL_ROPE_BASE = 10000.0
PATTERN = 6


def gguf_spec_fields(path: Path, meta: Meta, hidden: int, head_dim: int, layers: int) -> dict[str, Any]:
    """Gemma 3's fields of the spec: the queries scaled by the head size the file gives (key_length:
    query_pre_attn_scalar of every size but 27B, whose file llama.cpp special-cases); a file's
    pattern (attention.sliding_window_pattern: a period, or one flag a layer) wins over the default
    period."""
    window = int(meta("attention.sliding_window", 0, required=False) or 0)
    pattern = meta("attention.sliding_window_pattern", PATTERN, required=False)
    if isinstance(pattern, list):
        if len(pattern) != layers:
            raise CheckpointError(f"{path}: attention.sliding_window_pattern has {len(pattern)} flags")
        local = tuple(i for i, flag in enumerate(pattern) if flag)
    else:
        local = tuple(i for i in range(layers) if (i + 1) % int(pattern) != 0)
    return {
        "embed_scale": float(np.sqrt(np.float32(hidden))),
        "qk_norm": True,
        "post_norms": True,
        "activation": "gelu_tanh",
        "attention_scale": 1.0 / float(np.sqrt(head_dim)),
        "sliding_window": window,
        "local_layers": local if window else (),
        "rope_local_theta": float(meta("rope.freq_base_swa", LOCAL_ROPE_BASE, required=False)),
    }


# Llama's names, but post_attention_layernorm: Gemma's norm of the attention's output, its FFN's
# pre-norm being pre_feedforward_layernorm
HF_LAYER_NAMES = llama.HF_LAYER_NAMES | {
    "self_attn.q_norm.weight": "q_norm",
    "self_attn.k_norm.weight": "k_norm",
    "post_attention_layernorm.weight": "post_attn_norm",
    "pre_feedforward_layernorm.weight": "ffn_norm",
    "post_feedforward_layernorm.weight": "post_ffn_norm",
}
NORMS = ("attn_norm", "q_norm", "k_norm", "post_attn_norm", "ffn_norm", "post_ffn_norm", "final_norm")


def hf_spec_fields(config: dict[str, Any]) -> dict[str, Any]:
    """A gemma3_text config's fields: RoPE bases per layer type (transformers 5's rope_parameters
    by layer type, or 4's rope_local_base_freq), the local layers from layer_types (else every 6th
    global), the queries scaled by query_pre_attn_scalar. An encoder's window (config.json's, which
    transformers halves) spans sliding_window // 2 positions either side."""
    hidden, layers = int(config["hidden_size"]), int(config["num_hidden_layers"])
    by_type = config.get("rope_parameters") or {}
    local_rope = by_type.get("sliding_attention", {}).get("rope_theta", config.get("rope_local_base_freq"))
    types = config.get("layer_types") or [
        "full_attention" if (i + 1) % PATTERN == 0 else "sliding_attention" for i in range(layers)
    ]
    bidirectional = bool(config.get("use_bidirectional_attention", False))
    window = int(config.get("sliding_window") or 0)
    if bidirectional and window:
        window = window // 2 + 1
    return {
        "embed_scale": float(np.sqrt(np.float32(hidden))),
        "qk_norm": True,
        "post_norms": True,
        "activation": "gelu_tanh",
        "attention_scale": float(config.get("query_pre_attn_scalar", 256)) ** -0.5,
        "sliding_window": window,
        "local_layers": tuple(i for i, t in enumerate(types) if t == "sliding_attention") if window else (),
        "rope_local_theta": float(local_rope or LOCAL_ROPE_BASE),
        "bidirectional": bidirectional,
    }


def shift_norms(tensors: dict[str, np.ndarray], spec: ModelSpec) -> None:
    """A Transform: Gemma's RMSNorm multiplies by 1 + w, as the GGUF converter writes it."""
    for name in tensors:
        if name.rpartition(".")[2] in NORMS:
            tensors[name] = tensors[name] + np.float32(1)


FAMILY = Family(
    "gemma3",
    gguf=GgufLayout(
        "gemma3",
        GGUF_LAYER_NAMES,
        llama.GGUF_GLOBAL_NAMES,
        spec_fields=gguf_spec_fields,
        chat_template="gemma.jinja",  # the GGUF files carry none
    ),
    hf=HfLayout(
        "gemma3_text",
        HF_LAYER_NAMES,
        llama.HF_GLOBAL_NAMES,
        transform=shift_norms,
        spec_fields=hf_spec_fields,
    ),
)
