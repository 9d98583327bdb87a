"""A tiny Qwen3-MoE built by Hugging Face `transformers` (its reference implementation), random
float32 weights and Qwen3's real vocabulary (the suite's qwen2): saved as a Hugging Face directory and
written to GGUF as llama.cpp's converter writes qwen3moe (each layer's experts as 3-D tensors
[experts, out, in]), with the experts' matrices in F32 or a block format; the model whose experts
hold exactly a format's dequantized values is the reference for that file."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np

import hf_reference as hf
from tools.make_gguf import random_blocks

T = gguf.GGMLQuantizationType
VOCABULARY = "qwen3"  # hf_reference's family whose vocabulary Qwen3-MoE shares
EXPERT_GGUF = {"gate_proj": "ffn_gate_exps", "up_proj": "ffn_up_exps", "down_proj": "ffn_down_exps"}


def build(directory: Path, seed: int, hidden: int = 64, expert_ffn: int = 64, **config):
    """2 layers, 4 query heads of 32, 2 KV heads, 8 experts of which 2 a token (normalised), weights
    spread as hf_reference.build's (matrices N(0, 1/in), the router's too, embedding N(0, 1), norms
    1 + N(0, 0.1)); saved to `directory`; returns the model (float32, eval)."""
    import torch
    import transformers

    fields = hf.vocabulary_fields(VOCABULARY)
    special = {k: fields[f"tokenizer.ggml.{k}"] for k in ("bos_token_id", "eos_token_id")}
    settings = {
        "vocab_size": len(fields["tokenizer.ggml.tokens"]),
        "hidden_size": hidden,
        "intermediate_size": 128,
        "moe_intermediate_size": expert_ffn,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "norm_topk_prob": True,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "max_position_embeddings": 512,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": True,
        **special,
        **config,
    }
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(
        transformers.Qwen3MoeConfig(**settings), dtype=torch.float32
    )
    with torch.no_grad():
        for name, weight in model.named_parameters():
            if "norm" in name:
                weight.copy_(1 + 0.1 * torch.randn_like(weight))
            elif name == "model.embed_tokens.weight":
                weight.normal_(0, 1)
            else:  # [.., out, in]: the experts' stacked [E, out, in] too
                weight.normal_(0, weight.shape[-1] ** -0.5)
    model.eval()
    model.save_pretrained(directory, safe_serialization=True)
    return model


def expert_tensors(hf_dir: Path) -> dict[str, np.ndarray]:
    """Each MoE layer's experts from the directory as llama.cpp's 3-D tensors (GGUF name -> [E, out, in])."""
    from safetensors.numpy import load_file

    tensors = load_file(str(hf_dir / "model.safetensors"))
    config = json.loads((hf_dir / "config.json").read_text())
    experts = config.get("num_experts") or config["num_local_experts"]
    out = {}
    for i in range(config["num_hidden_layers"]):
        for proj, name in EXPERT_GGUF.items():
            key = f"model.layers.{i}.mlp.experts.{{}}.{proj}.weight"
            if key.format(0) in tensors:
                out[f"blk.{i}.{name}.weight"] = np.stack([tensors[key.format(e)] for e in range(experts)])
    return out


def quantized_experts(
    experts: dict[str, np.ndarray], qtype: gguf.GGMLQuantizationType, seed: int
) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Each 3-D expert tensor in `qtype`: (file data [E * out, row bytes], its dequantized values
    [E, out, in]). Q8_0 and Q4_0 quantize the model's weights (gguf's quantizer); the K-quants, which
    gguf cannot quantize, are random blocks of the weights' size (tools.make_gguf)."""
    rng = np.random.default_rng(seed)
    out = {}
    for name, values in experts.items():
        e, rows, cols = values.shape
        if qtype in (T.Q8_0, T.Q4_0):
            data = gguf.quants.quantize(values.reshape(e * rows, cols), qtype)
        else:
            data = random_blocks(qtype, e * rows, cols, rng, scale=cols**-0.5)
        dequantized = gguf.quants.dequantize(data, qtype).reshape(e, rows, cols).astype(np.float32)
        out[name] = data, dequantized
    return out


def with_experts(model, experts: dict[str, np.ndarray]):
    """A copy of the transformers model whose experts hold `experts` (GGUF name -> [E, out, in])."""
    import copy

    import torch

    twin = copy.deepcopy(model)
    with torch.no_grad():
        for i, layer in enumerate(twin.model.layers):
            gate, up = (
                experts.get(f"blk.{i}.ffn_gate_exps.weight"),
                experts.get(f"blk.{i}.ffn_up_exps.weight"),
            )
            if gate is None:
                continue
            layer.mlp.experts.gate_up_proj.copy_(torch.from_numpy(np.concatenate([gate, up], 1)))
            layer.mlp.experts.down_proj.copy_(torch.from_numpy(experts[f"blk.{i}.ffn_down_exps.weight"]))
    return twin


def write_gguf(
    hf_dir: Path, path: Path, qtype: gguf.GGMLQuantizationType = T.F32, seed: int = 0
) -> tuple[Path, dict[str, np.ndarray]]:
    """The directory's model as llama.cpp's converter writes qwen3moe: attention, norms, router and
    embedding F32, the experts 3-D in `qtype`. Returns the file and the experts' values as it holds
    them (GGUF name -> [E, out, in]: the dequantized ones for a block format)."""
    from safetensors.numpy import load_file

    config = json.loads((hf_dir / "config.json").read_text())
    heads, kv_heads, head_dim = (
        config["num_attention_heads"],
        config["num_key_value_heads"],
        config["head_dim"],
    )
    writer = gguf.GGUFWriter(str(path), "qwen3moe")
    writer.add_name("tiny-qwen3moe")
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_expert_feed_forward_length(config["moe_intermediate_size"])
    writer.add_expert_count(config.get("num_experts") or config["num_local_experts"])
    writer.add_expert_used_count(config["num_experts_per_tok"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_freq_base(config["rope_parameters"]["rope_theta"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_vocab_size(config["vocab_size"])
    hf.add_vocabulary(writer, hf.vocabulary_fields(VOCABULARY))
    for hf_name, array in sorted(load_file(str(hf_dir / "model.safetensors")).items()):
        if hf_name in hf.GLOBAL_NAMES:
            writer.add_tensor(hf.GLOBAL_NAMES[hf_name], np.ascontiguousarray(array, np.float32))
            continue
        index, rest = hf_name[len("model.layers.") :].split(".", 1)
        if rest == "mlp.gate.weight":
            writer.add_tensor(f"blk.{index}.ffn_gate_inp.weight", np.ascontiguousarray(array, np.float32))
        elif not rest.startswith("mlp.experts."):
            writer.add_tensor(f"blk.{index}.{hf.GGUF_NAMES[rest]}", np.ascontiguousarray(array, np.float32))
    experts = expert_tensors(hf_dir)
    if qtype == T.F32:
        for name, values in experts.items():
            writer.add_tensor(name, np.ascontiguousarray(values, np.float32))
    else:
        for name, (data, values) in quantized_experts(experts, qtype, seed).items():
            e, rows, _ = values.shape
            writer.add_tensor(name, data.reshape(e, rows, -1), raw_dtype=qtype)
            experts[name] = values
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path, experts
