"""Qwen3.5-MoE (Qwen3.5-35B-A3B and larger): Qwen3.5's hybrid of Gated DeltaNet and gated attention
layers (qwen35.py), each layer's FFN Qwen3-MoE's routed experts (qwen3moe.py; the chosen experts'
weights always renormalised, as transformers' router and llama.cpp's graph do) plus a shared expert
that every token runs, its output weighted by sigmoid(norm(x) . shared_expert_gate)
(agent/kernels/moe.cc)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from agent.model.families import llama, qwen3moe, qwen35
from agent.model.families.base import Family, GgufLayout, HfLayout, Meta

GGUF_SHARED_NAMES = {
    "ffn_gate_inp_shexp.weight": "shared_expert_gate",
    "ffn_gate_shexp.weight": "shared_expert.w_gate",
    "ffn_up_shexp.weight": "shared_expert.w_up",
    "ffn_down_shexp.weight": "shared_expert.w_down",
}
HF_MOE_NAMES = {
    "mlp.gate.weight": "router",
    "mlp.shared_expert_gate.weight": "shared_expert_gate",
    "mlp.shared_expert.gate_proj.weight": "shared_expert.w_gate",
    "mlp.shared_expert.up_proj.weight": "shared_expert.w_up",
    "mlp.shared_expert.down_proj.weight": "shared_expert.w_down",
}


def gguf_spec_fields(path: Path, meta: Meta, hidden: int, head_dim: int, layers: int) -> dict[str, Any]:
    experts = qwen3moe.gguf_spec_fields(path, meta, hidden, head_dim, layers)
    shared = meta("expert_shared_feed_forward_length", experts["expert_intermediate_size"], required=False)
    return {
        **qwen35.gguf_spec_fields(path, meta, hidden, head_dim, layers),
        **experts,
        "norm_topk_prob": True,  # llama.cpp's qwen35moe graph renormalises whatever the file says
        "shared_expert_intermediate_size": int(shared),
    }


def hf_spec_fields(config: dict[str, Any]) -> dict[str, Any]:
    experts = qwen3moe.hf_spec_fields(config)
    return {
        **qwen35.hf_spec_fields(config),
        **experts,
        "norm_topk_prob": True,  # Qwen3_5MoeTopKRouter renormalises; its config has no such key
        "shared_expert_intermediate_size": int(
            config.get("shared_expert_intermediate_size") or experts["expert_intermediate_size"]
        ),
    }


FAMILY = Family(
    "qwen35moe",
    gguf=GgufLayout(
        "qwen35moe",
        qwen35.GGUF_LAYER_NAMES | qwen3moe.GGUF_EXPERT_NAMES | GGUF_SHARED_NAMES,
        llama.GGUF_GLOBAL_NAMES,
        spec_fields=gguf_spec_fields,
    ),
    hf=HfLayout(
        "qwen3_5_moe_text",
        qwen3moe.HfLayerNames(qwen35.HF_LAYER_NAMES | HF_MOE_NAMES),
        llama.HF_GLOBAL_NAMES,
        transform=qwen35.hf_transform,
        spec_fields=hf_spec_fields,
        multimodal="qwen3_5_moe",
    ),
)
