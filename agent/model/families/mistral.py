"""Mistral (Hugging Face directories; its GGUF files are llama.cpp's `llama` architecture): Llama's
layout under model_type "mistral", and where config.json sets a sliding window (Mistral 7B v0.1's
4,096) every layer attends within it."""

from __future__ import annotations

from typing import Any

from agent.model.families import llama
from agent.model.families.base import Family, HfLayout


def hf_spec_fields(config: dict[str, Any]) -> dict[str, Any]:
    window = int(config.get("sliding_window") or 0)
    if not window or window >= int(config.get("max_position_embeddings", 0)):
        return {}  # a window no sequence reaches: full attention
    return {"sliding_window": window, "local_layers": tuple(range(int(config["num_hidden_layers"])))}


FAMILY = Family(
    "mistral", hf=HfLayout("mistral", llama.HF_LAYER_NAMES, llama.HF_GLOBAL_NAMES, spec_fields=hf_spec_fields)
)
