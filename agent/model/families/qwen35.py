"""Qwen3.5 (dense): a hybrid of Gated DeltaNet layers (linear attention, a fixed-size state per
sequence: agent/kernels/gated_delta.h) and gated full attention, one of every
full_attention_interval (4) layers: layer i attends where (i + 1) % 4 == 0. The attention layers have
QK-norm, RoPE on the first quarter of each head (rope.dimension_count; Qwen3.5's interleaved MRoPE is
plain RoPE for text, whose three position ids are equal) and an output gate (wq's rows hold each
head's query then its gate; the head's output is multiplied by sigmoid(gate)).

In llama.cpp's files (its converter's Qwen3NextModel and Qwen3_5TextModel classes) the
norms hold Qwen3.5's 1 + w already, but not the linear attention's own gated norm; A is stored as
-exp(A_log); and where value heads outnumber key heads the value heads are in tiled order (value
head h reads key head h % key_heads). A Hugging Face directory is brought to the same form at load:
a Qwen3_5ForCausalLM's (qwen3_5_text), or the published multimodal checkpoints' language model
(qwen3_5: the text_config, the tensors under model.language_model.; the vision tower not read).
A file's MTP layers (nextn_predict_layers, after the model's own) are not read."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from agent.model.checkpoint import DELTA_TENSORS, CheckpointError
from agent.model.families import llama
from agent.model.families.base import Family, GgufLayout, HfLayout, Meta
from agent.model.spec import LinearAttention, ModelSpec

INTERVAL = 4  # llama.cpp's and transformers' default full_attention_interval

GGUF_LAYER_NAMES = llama.GGUF_LAYER_NAMES | {
    "post_attention_norm.weight": "ffn_norm",
    "attn_q_norm.weight": "q_norm",
    "attn_k_norm.weight": "k_norm",
    "attn_qkv.weight": "delta_qkv",
    "attn_gate.weight": "delta_z",
    "ssm_beta.weight": "delta_beta",
    "ssm_alpha.weight": "delta_alpha",
    "ssm_out.weight": "delta_out",
    "ssm_conv1d.weight": "delta_conv",
    "ssm_dt.bias": "delta_dt_bias",
    "ssm_a": "delta_a",
    "ssm_norm.weight": "delta_norm",
}
HF_LAYER_NAMES = llama.HF_LAYER_NAMES | {
    "self_attn.q_norm.weight": "q_norm",
    "self_attn.k_norm.weight": "k_norm",
    "linear_attn.in_proj_qkv.weight": "delta_qkv",
    "linear_attn.in_proj_z.weight": "delta_z",
    "linear_attn.in_proj_b.weight": "delta_beta",
    "linear_attn.in_proj_a.weight": "delta_alpha",
    "linear_attn.out_proj.weight": "delta_out",
    "linear_attn.conv1d.weight": "delta_conv",
    "linear_attn.dt_bias": "delta_dt_bias",
    "linear_attn.A_log": "delta_a",
    "linear_attn.norm.weight": "delta_norm",
}
# Qwen3.5's RMSNorms multiply by 1 + w (a GGUF holds 1 + w); the gated norm (delta_norm) by w
ZERO_CENTERED = ("attn_norm", "ffn_norm", "q_norm", "k_norm")


def linear_layers(layers: int, interval: int) -> tuple[int, ...]:
    return tuple(i for i in range(layers) if (i + 1) % interval != 0)


def gguf_spec_fields(path: Path, meta: Meta, hidden: int, head_dim: int, layers: int) -> dict[str, Any]:
    """The spec's Qwen3.5 fields from llama.cpp's keys (its converter's Qwen3NextModel)."""
    value_heads, inner = int(meta("ssm.time_step_rank")), int(meta("ssm.inner_size"))
    if inner % value_heads:
        raise CheckpointError(f"{path}: ssm.inner_size {inner} is not a multiple of {value_heads} heads")
    flags = meta("attention.recurrent_layers", None, required=False)  # one a layer (MTP layers after)
    if flags is None:
        linear = linear_layers(layers, int(meta("full_attention_interval", INTERVAL, required=False)))
    elif len(flags) < layers:
        raise CheckpointError(
            f"{path}: attention.recurrent_layers has {len(flags)} flags for {layers} layers"
        )
    else:
        linear = tuple(i for i in range(layers) if flags[i])
    return {
        "qk_norm": True,
        "output_gate": True,
        "rotary_dim": int(meta("rope.dimension_count", head_dim, required=False)),
        "linear_attention": LinearAttention(
            layers=linear,
            conv_kernel=int(meta("ssm.conv_kernel")),
            key_heads=int(meta("ssm.group_count")),
            value_heads=value_heads,
            key_dim=int(meta("ssm.state_size")),
            value_dim=inner // value_heads,
        ),
    }


def hf_spec_fields(config: dict[str, Any]) -> dict[str, Any]:
    """The spec's Qwen3.5 fields from config.json (Qwen3_5TextConfig)."""
    layers = int(config["num_hidden_layers"])
    types = config.get("layer_types")
    if types is None:
        linear = linear_layers(layers, int(config.get("full_attention_interval", INTERVAL)))
    elif len(types) != layers:
        raise CheckpointError(f"layer_types has {len(types)} entries for {layers} layers")
    else:
        linear = tuple(i for i, kind in enumerate(types) if kind == "linear_attention")
    head_dim = int(config.get("head_dim") or int(config["hidden_size"]) // int(config["num_attention_heads"]))
    rope = config.get("rope_parameters") or {}
    factor = float(rope.get("partial_rotary_factor", config.get("partial_rotary_factor", 0.25)))
    return {
        "qk_norm": True,
        "output_gate": True,
        "rotary_dim": int(head_dim * factor),
        "linear_attention": LinearAttention(
            layers=linear,
            conv_kernel=int(config.get("linear_conv_kernel_dim", 4)),
            key_heads=int(config["linear_num_key_heads"]),
            value_heads=int(config["linear_num_value_heads"]),
            key_dim=int(config["linear_key_head_dim"]),
            value_dim=int(config["linear_value_head_dim"]),
        ),
    }


def tiled_heads(shape: LinearAttention, size: int) -> np.ndarray:
    """The order that takes value heads (each `size` rows) from grouped by key head to tiled:
    llama.cpp's converter's _reorder_v_heads, as row indices."""
    per_key = shape.value_heads // shape.key_heads
    return (
        np.arange(shape.value_heads * size).reshape(shape.key_heads, per_key, size).transpose(1, 0, 2).ravel()
    )


def hf_transform(tensors: dict[str, np.ndarray], spec: ModelSpec) -> None:
    """A Hugging Face directory's tensors as llama.cpp's converter writes them (module docstring)."""
    shape = spec.linear_attention
    assert shape is not None
    for name in [n for n in tensors if n.rpartition(".")[2] in ZERO_CENTERED or n == "final_norm"]:
        tensors[name] = tensors[name] + 1.0
    dv, keys = shape.value_dim, 2 * shape.key_heads * shape.key_dim
    rows, heads = tiled_heads(shape, dv), tiled_heads(shape, 1)
    for layer in shape.layers:
        p = f"layers.{layer}."
        if not all(p + name in tensors for name in DELTA_TENSORS):
            continue  # validation names what is missing
        qkv = tensors[p + "delta_qkv"]
        tensors[p + "delta_qkv"] = np.concatenate([qkv[:keys], qkv[keys:][rows]])
        conv = tensors[p + "delta_conv"].reshape(shape.channels, -1)
        tensors[p + "delta_conv"] = np.concatenate([conv[:keys], conv[keys:][rows]])
        tensors[p + "delta_z"] = tensors[p + "delta_z"][rows]
        tensors[p + "delta_out"] = np.ascontiguousarray(tensors[p + "delta_out"][:, rows])
        for name in ("delta_beta", "delta_alpha", "delta_dt_bias"):
            tensors[p + name] = tensors[p + name][heads]
        tensors[p + "delta_a"] = -np.exp(tensors[p + "delta_a"][heads])


FAMILY = Family(
    "qwen35",
    gguf=GgufLayout("qwen35", GGUF_LAYER_NAMES, llama.GGUF_GLOBAL_NAMES, spec_fields=gguf_spec_fields),
    hf=HfLayout(
        "qwen3_5_text",
        HF_LAYER_NAMES,
        llama.HF_GLOBAL_NAMES,
        transform=hf_transform,
        spec_fields=hf_spec_fields,
        multimodal="qwen3_5",
    ),
)
