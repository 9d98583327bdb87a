"""Gemma 3 (GGUF): Llama's layout plus QK-norm and a norm after the attention and after the FFN
(four a layer, a GGUF's weights already holding Gemma's 1 + w), GeGLU, embeddings scaled by
sqrt(hidden), the queries scaled by the file's head size, and sliding-window layers with a RoPE
base of their own. The shared layers run these on the fused CPU kernel only (agent/graphs/decoder.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from agent.model.checkpoint import CheckpointError
from agent.model.families import llama
from agent.model.families.base import Family, GgufLayout, Meta

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


FAMILY = Family(
    "gemma3",
    gguf=GgufLayout(
        "gemma3",
        GGUF_LAYER_NAMES,
        llama.GGUF_GLOBAL_NAMES,
        spec_fields=gguf_spec_fields,
        chat_template="gemma.jinja",  # the GGUF files carry none
    ),
)
