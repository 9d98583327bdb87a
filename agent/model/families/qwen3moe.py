"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen3's attention (QK-norm, a head size of its own)
with a sparse FFN on each layer: a router [experts, hidden] whose softmax picks the top
experts_per_token experts of a token (their weights renormalised to sum to 1 where norm_topk_prob),
each a SwiGLU of its own (agent/graphs/moe.py). llama.cpp stores each layer's experts as one 3-D
tensor per matrix [experts, out, in] (ffn_gate_exps, ffn_up_exps, ffn_down_exps; the GGUF reader
splits them per expert), Hugging Face as one tensor per expert and matrix."""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from agent.model.families import llama
from agent.model.families.base import Family, GgufLayout, HfLayout, Meta

QK_NORM_GGUF = {"attn_q_norm.weight": "q_norm", "attn_k_norm.weight": "k_norm"}
QK_NORM_HF = {"self_attn.q_norm.weight": "q_norm", "self_attn.k_norm.weight": "k_norm"}
GGUF_EXPERT_NAMES = {
    "ffn_gate_inp.weight": "router",
    "ffn_gate_exps.weight": "experts.w_gate",  # [experts, Fe, D]: split into experts.<e>.w_gate
    "ffn_up_exps.weight": "experts.w_up",
    "ffn_down_exps.weight": "experts.w_down",
}
HF_EXPERT = re.compile(r"mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight")


class HfLayerNames(Mapping[str, str]):
    """Qwen3's names, the router's, and each expert's "mlp.experts.<e>.<gate|up|down>_proj.weight"
    (-> "experts.<e>.w_<gate|up|down>") for any number of experts."""

    def __init__(self, names: Mapping[str, str]):
        self.names = dict(names)

    def __getitem__(self, name: str) -> str:
        if name in self.names:
            return self.names[name]
        match = HF_EXPERT.fullmatch(name)
        if match is None:
            raise KeyError(name)
        return f"experts.{match[1]}.w_{match[2]}"

    def __iter__(self) -> Iterator[str]:
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)


def gguf_spec_fields(path: Path, meta: Meta, hidden: int, head_dim: int, layers: int) -> dict[str, Any]:
    # llama.cpp's qwen3moe graph renormalises the chosen experts' weights (norm_topk_prob: true)
    return {
        "qk_norm": True,
        "num_experts": int(meta("expert_count")),
        "experts_per_token": int(meta("expert_used_count")),
        "expert_intermediate_size": int(meta("expert_feed_forward_length")),
        "norm_topk_prob": bool(meta("expert_weights_norm", True, required=False)),
    }


def hf_spec_fields(config: dict[str, Any]) -> dict[str, Any]:
    layers = int(config["num_hidden_layers"])
    step = int(config.get("decoder_sparse_step") or 1)
    dense_only = set(config.get("mlp_only_layers") or ())
    return {
        "qk_norm": True,
        # transformers 5 writes num_local_experts, the Qwen3-MoE checkpoints num_experts
        "num_experts": int(config.get("num_experts") or config["num_local_experts"]),
        "experts_per_token": int(config["num_experts_per_tok"]),
        "expert_intermediate_size": int(config["moe_intermediate_size"]),
        "norm_topk_prob": bool(config.get("norm_topk_prob", False)),
        # transformers' Qwen3MoeDecoderLayer: dense where listed or off the sparse step
        "dense_layers": tuple(i for i in range(layers) if i in dense_only or (i + 1) % step),
    }


FAMILY = Family(
    "qwen3moe",
    gguf=GgufLayout(
        "qwen3moe",
        llama.GGUF_LAYER_NAMES | QK_NORM_GGUF | GGUF_EXPERT_NAMES,
        llama.GGUF_GLOBAL_NAMES,
        spec_fields=gguf_spec_fields,
    ),
    hf=HfLayout(
        "qwen3_moe",
        HfLayerNames(llama.HF_LAYER_NAMES | QK_NORM_HF | {"mlp.gate.weight": "router"}),
        llama.HF_GLOBAL_NAMES,
        spec_fields=hf_spec_fields,
    ),
)
