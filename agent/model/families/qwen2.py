"""Qwen2 and Qwen2.5: Llama's layout with a bias on the Q, K and V projections, and Q/K rows in the
rotate-half order in GGUF files (llama.cpp's converter permutes only Llama's)."""

from __future__ import annotations

from agent.model.families import llama
from agent.model.families.base import Family, GgufLayout, HfLayout

FAMILY = Family(
    "qwen2",
    gguf=GgufLayout(
        "qwen2", llama.GGUF_LAYER_NAMES | llama.GGUF_BIAS_NAMES, llama.GGUF_GLOBAL_NAMES, qkv_bias=True
    ),
    hf=HfLayout("qwen2", llama.HF_LAYER_NAMES, llama.HF_GLOBAL_NAMES, qkv_bias=True),
)
