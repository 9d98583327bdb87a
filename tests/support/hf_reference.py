"""Tiny models of each family built by Hugging Face `transformers` (the families' reference
implementation; the `reference` extra), with random float32 weights and a real vocabulary of the
family (llama.cpp's tokenizer suite, models/llama-vocab/): saved as a Hugging Face directory, written
to GGUF in llama.cpp's layout with that vocabulary, and their greedy answers by `generate`."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import gguf
import numpy as np

from agent.model.formats.gguf_header import GgufFile
from config.schema import PROJECT_ROOT

VOCABULARIES = PROJECT_ROOT / "models" / "llama-vocab"
# llama.cpp's converter: every HF name after "model.layers.<i>." -> its GGUF name after "blk.<i>."
GGUF_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.qkv_proj.weight": "attn_qkv.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.gate_up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
# Qwen3.5's (llama.cpp's qwen35/qwen35moe tensor lists): post_attention_layernorm is
# post_attention_norm there (no ffn_norm), the DeltaNet's tensors, the MoE's (experts stacked)
QWEN35_NAMES = {
    **GGUF_NAMES,
    "post_attention_layernorm.weight": "post_attention_norm.weight",
    "linear_attn.in_proj_qkv.weight": "attn_qkv.weight",
    "linear_attn.in_proj_z.weight": "attn_gate.weight",
    "linear_attn.in_proj_a.weight": "ssm_alpha.weight",
    "linear_attn.in_proj_b.weight": "ssm_beta.weight",
    "linear_attn.A_log": "ssm_a",
    "linear_attn.dt_bias": "ssm_dt.bias",
    "linear_attn.conv1d.weight": "ssm_conv1d.weight",
    "linear_attn.norm.weight": "ssm_norm.weight",
    "linear_attn.out_proj.weight": "ssm_out.weight",
    "mlp.gate.weight": "ffn_gate_inp.weight",
    "mlp.shared_expert_gate.weight": "ffn_gate_inp_shexp.weight",
    "mlp.shared_expert.gate_proj.weight": "ffn_gate_shexp.weight",
    "mlp.shared_expert.up_proj.weight": "ffn_up_shexp.weight",
    "mlp.shared_expert.down_proj.weight": "ffn_down_shexp.weight",
    "mlp.experts.gate_proj.weight": "ffn_gate_exps.weight",
    "mlp.experts.up_proj.weight": "ffn_up_exps.weight",
    "mlp.experts.down_proj.weight": "ffn_down_exps.weight",
}
GLOBAL_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
LLAMA3_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,  # positions past 64 blend, as Llama 3.1's past 8,192
}

# Qwen3.5's hybrid: three Gated DeltaNet layers then a gated full attention (every fourth), its
# rotary on a quarter of the head (8 of 32 dims); 4 V heads over 2 K heads, so the converter's
# V-head reorder moves rows
QWEN35 = {
    "num_hidden_layers": 4,
    "layer_types": ["linear_attention"] * 3 + ["full_attention"],
    "full_attention_interval": 4,
    "head_dim": 32,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25},
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "linear_conv_kernel_dim": 4,
    "tie_word_embeddings": False,
}


@dataclass(frozen=True)
class TinyFamily:
    """A family's tiny model: its transformers config class, the suite's vocabulary its real models
    use, the GGUF architecture llama.cpp writes it as ("": none, Mistral's sliding window is not in
    llama.cpp's files), and its config beyond the shared shape."""

    config_class: str
    vocabulary: str
    gguf_arch: str
    config: dict = field(default_factory=dict)
    zero_centered_norms: bool = False  # RMSNorm by (1 + w), the converter adding the 1
    multimodal: str = ""  # the model_type of the published checkpoints holding it as their language model


FAMILIES = {
    "llama3": TinyFamily(
        "LlamaConfig", "llama-bpe", "llama", {"rope_theta": 500000.0, "rope_scaling": LLAMA3_SCALING}
    ),
    "llama3-tied": TinyFamily("LlamaConfig", "llama-bpe", "llama", {"tie_word_embeddings": True}),
    "mistral": TinyFamily("MistralConfig", "llama-spm", "", {"sliding_window": 48}),
    "qwen3": TinyFamily("Qwen3Config", "qwen2", "qwen3", {"head_dim": 32, "tie_word_embeddings": True}),
    "phi3": TinyFamily("Phi3Config", "phi-3", "phi3", {"pad_token_id": None}),
    # four layers: the last one rotates nothing (NoPE, every fourth)
    "smollm3": TinyFamily(
        "SmolLM3Config", "llama-bpe", "smollm3", {"num_hidden_layers": 4, "tie_word_embeddings": True}
    ),
    # Gemma 3 from its Hugging Face directory (Gemma3ForCausalLM, gemma3_text): two local layers (a
    # window of 16) then a global one, QK-norm, four norms a layer (1 + w), GeGLU, scaled embeddings
    "gemma3": TinyFamily(
        "Gemma3TextConfig",
        "llama-spm",
        "",
        {
            "num_hidden_layers": 3,
            "head_dim": 32,
            "query_pre_attn_scalar": 32,
            "sliding_window": 16,
            "layer_types": ["sliding_attention", "sliding_attention", "full_attention"],
            "tie_word_embeddings": True,
            "pad_token_id": 0,
        },
        zero_centered_norms=True,
    ),
    "qwen35": TinyFamily(
        "Qwen3_5TextConfig", "qwen35", "qwen35", QWEN35, zero_centered_norms=True, multimodal="qwen3_5"
    ),
    "qwen35moe": TinyFamily(
        "Qwen3_5MoeTextConfig",
        "qwen35",
        "qwen35moe",
        {
            **QWEN35,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "shared_expert_intermediate_size": 32,
        },
        zero_centered_norms=True,
        multimodal="qwen3_5_moe",
    ),
}


def vocabulary_path(family: str) -> Path:
    return VOCABULARIES / f"ggml-vocab-{FAMILIES[family].vocabulary}.gguf"


def vocabulary_fields(family: str) -> dict:
    """The suite file's tokenizer.* fields (the project's GGUF reader: the gguf package's takes
    minutes over a vocabulary's 280,000 merges)."""
    values = GgufFile(vocabulary_path(family)).values
    return {key: value for key, value in values.items() if key.startswith("tokenizer.")}


def suite_texts(family: str) -> list[str]:
    """The vocabulary's own test texts (llama.cpp's .inp file), the empty and blank ones left out."""
    text = Path(f"{vocabulary_path(family)}.inp").read_text(encoding="utf-8")
    return [t for t in text.split("\n__ggml_vocab_test__\n") if t.strip()]


def add_vocabulary(writer: gguf.GGUFWriter, fields: dict) -> None:
    """The vocabulary's tokenizer.* keys (vocabulary_fields), and any more of these types (a list,
    bool, int or str each), into a GGUF being written."""
    for key, value in fields.items():
        if isinstance(value, list):
            writer.add_array(key, value)
        elif isinstance(value, bool):
            writer.add_bool(key, value)
        elif isinstance(value, int):
            writer.add_uint32(key, value)
        else:
            writer.add_string(key, value)


def build(family: str, directory: Path, seed: int):
    """The family's tiny model (2 layers unless its config says, hidden 64, 4 query heads, 2 KV heads,
    FFN 128) with random weights spread so logits are far apart (transformers' init of 0.02 gives
    near-ties everywhere): matrices N(0, 1/in), embedding N(0, 1), an untied LM head 4x, norms
    1 + N(0, 0.1) (zero-centred ones N(0, 0.1)), Qwen3.5's DeltaNet A in [1, 8], dt_bias N(0, 0.5),
    conv1d taps N(0, 1/K). Saved as safetensors with its config to `directory`; returns the model
    (float32, eval)."""
    import torch
    import transformers

    tiny = FAMILIES[family]
    fields = vocabulary_fields(family)
    tokens = len(fields["tokenizer.ggml.tokens"])
    special = {k: fields[f"tokenizer.ggml.{k}"] for k in ("bos_token_id", "eos_token_id")}
    shape = {
        "vocab_size": tokens,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 512,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
    }
    config = getattr(transformers, tiny.config_class)(**{**shape, **special, **tiny.config})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, weight in model.named_parameters():
            if "norm" in name:
                centre = 0 if tiny.zero_centered_norms and "linear_attn.norm" not in name else 1
                weight.copy_(centre + 0.1 * torch.randn_like(weight))
            elif name == "model.embed_tokens.weight":
                weight.normal_(0, 1)
            elif name.endswith(".A_log"):  # decays exp(-A softplus(a + dt_bias)), A in [1, 8]
                weight.copy_(torch.empty_like(weight).uniform_(1, 8).log())
            elif name.endswith(".dt_bias"):
                weight.normal_(0, 0.5)
            else:  # the last axis is the input (an expert's, the conv1d's kernel taps)
                weight.normal_(0, weight.shape[-1] ** -0.5 * (4 if name == "lm_head.weight" else 1))
    model.eval()
    model.save_pretrained(directory, safe_serialization=True)
    return model


def write_multimodal(hf_dir: Path, directory: Path, family: str) -> Path:
    """The directory's model as the language model of a multimodal checkpoint, as Qwen3.5's are
    published (Qwen3_5ForConditionalGeneration): the config's text_config, the tensors under
    "model.language_model." but the LM head, beside a vision tower's and MTP tensors (random: a
    reader must leave them)."""
    from safetensors.numpy import load_file, save_file

    text = json.loads((hf_dir / "config.json").read_text())
    config = {
        "architectures": ["Qwen3_5ForConditionalGeneration"],
        "model_type": FAMILIES[family].multimodal,
        "text_config": text,
        "vision_config": {"model_type": "qwen3_5_vision", "depth": 1, "hidden_size": 16},
        "tie_word_embeddings": text["tie_word_embeddings"],
    }
    tensors = {
        name.replace("model.", "model.language_model.", 1) if name.startswith("model.") else name: array
        for name, array in load_file(str(hf_dir / "model.safetensors")).items()
    }
    rng = np.random.default_rng(0)
    tensors["model.visual.blocks.0.attn.qkv.weight"] = rng.standard_normal((48, 16)).astype(np.float32)
    tensors["mtp.layers.0.input_layernorm.weight"] = np.ones(text["hidden_size"], np.float32)
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(config))
    save_file(tensors, str(directory / "model.safetensors"))
    return directory


def greedy(model, prompt: list[int], n: int) -> tuple[list[int], float]:
    """transformers' greedy answer of n tokens (no stop token), and the smallest gap between its
    best two logits over the steps (how near a tie its choices came)."""
    import torch

    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),  # else pad_token_id's are masked
            do_sample=False,
            max_new_tokens=n,
            min_new_tokens=n,
            output_scores=True,
            return_dict_in_generate=True,
            pad_token_id=0,
        )
    gaps = [float(np.diff(np.sort(s[0].numpy())[-2:])[0]) for s in out.scores]
    return out.sequences[0, len(prompt) :].tolist(), min(gaps)


def write_gguf(hf_dir: Path, path: Path, family: str, extra: dict | None = None) -> Path:
    """The directory's model as llama.cpp's converter writes it (F32): its architecture's tensor
    names, a Llama's Q/K rows permuted to the interleaved RoPE order, Llama 3 scaling as the
    rope_freqs tensor, Qwen3.5's hybrid as add_qwen35_hparams and qwen35_tensors say, and the
    family's vocabulary (the suite file's tokenizer fields); `extra`: more keys (an embedding
    model's pooling_type, a reranker's labels), each int, bool, str or list of str."""
    from safetensors.numpy import load_file

    arch = FAMILIES[family].gguf_arch
    config = json.loads((hf_dir / "config.json").read_text())
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name(f"tiny-{family}")
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    rope = config["rope_parameters"]  # transformers 5 writes base and scaling here
    writer.add_rope_freq_base(rope["rope_theta"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_vocab_size(config["vocab_size"])
    qwen35 = arch in ("qwen35", "qwen35moe")
    if qwen35:
        add_qwen35_hparams(writer, arch, config, head_dim)
    add_vocabulary(writer, {**vocabulary_fields(family), **(extra or {})})
    tensors = load_file(str(hf_dir / "model.safetensors"))
    if rope["rope_type"] == "llama3":
        writer.add_tensor("rope_freqs.weight", llama3_factors(rope, head_dim))
    named = qwen35_tensors(tensors, config) if qwen35 else _llama_tensors(tensors, arch, heads, kv_heads)
    for name, array in named:
        writer.add_tensor(name, np.ascontiguousarray(array, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _llama_tensors(tensors: dict, arch: str, heads: int, kv_heads: int):
    """(GGUF name, array) of a Llama-like family's tensors, Llama's and SmolLM3's Q/K permuted."""
    for hf_name, array in sorted(tensors.items()):
        if hf_name in GLOBAL_NAMES:
            name = GLOBAL_NAMES[hf_name]
        else:
            index, rest = hf_name[len("model.layers.") :].split(".", 1)
            name = f"blk.{index}.{GGUF_NAMES[rest]}"
        if arch in ("llama", "smollm3") and name.endswith(("attn_q.weight", "attn_k.weight")):
            array = _permute(array, heads if "attn_q" in name else kv_heads)
        yield name, array


def add_qwen35_hparams(writer: gguf.GGUFWriter, arch: str, config: dict, head_dim: int) -> None:
    """What the converter writes for Qwen3.5 beyond the shared keys (Qwen2MoeModel, Qwen3NextModel,
    _Qwen35MRopeMixin): the experts' counts and sizes, the DeltaNet's shape as ssm.*, which layers
    are recurrent, the rotary's dims (a part of the head) and its M-RoPE sections (transformers'
    default [11, 11, 10] where the config has none)."""
    rope = config["rope_parameters"]
    if "num_experts" in config:
        writer.add_expert_count(config["num_experts"])
        writer.add_expert_used_count(config["num_experts_per_tok"])
        writer.add_expert_feed_forward_length(config["moe_intermediate_size"])
        writer.add_expert_shared_feed_forward_length(config["shared_expert_intermediate_size"])
    writer.add_ssm_conv_kernel(config["linear_conv_kernel_dim"])
    writer.add_ssm_state_size(config["linear_key_head_dim"])
    writer.add_ssm_group_count(config["linear_num_key_heads"])
    writer.add_ssm_time_step_rank(config["linear_num_value_heads"])
    writer.add_ssm_inner_size(config["linear_value_head_dim"] * config["linear_num_value_heads"])
    # the gguf package installed has no add_recurrent_layers
    recurrent = [kind == "linear_attention" for kind in config["layer_types"]]
    writer.add_array(f"{arch}.attention.recurrent_layers", recurrent)
    writer.add_full_attention_interval(config.get("full_attention_interval", 4))
    writer.add_rope_dimension_count(int(head_dim * rope.get("partial_rotary_factor", 0.25)))
    writer.add_rope_dimension_sections((list(rope.get("mrope_section", [11, 11, 10])) + [0] * 4)[:4])


def qwen35_tensors(tensors: dict, config: dict):
    """The converter's Qwen3.5 tensors (Qwen3NextModel, _LinearAttentionVReorderBase, Qwen2MoeModel),
    as (GGUF name, array): each as _qwen35_array, each layer's experts stacked [expert, out, in]."""
    experts: dict[tuple[str, str], dict[int, np.ndarray]] = {}
    for hf_name, array in sorted(tensors.items()):
        if hf_name in GLOBAL_NAMES:
            yield GLOBAL_NAMES[hf_name], _qwen35_array(hf_name, array, config)
            continue
        index, rest = hf_name[len("model.layers.") :].split(".", 1)
        if rest.startswith("mlp.experts."):
            expert, kind = rest[len("mlp.experts.") :].split(".", 1)
            experts.setdefault((index, kind), {})[int(expert)] = array
        else:
            yield f"blk.{index}.{QWEN35_NAMES[rest]}", _qwen35_array(rest, array, config)
    for (index, kind), by_expert in experts.items():
        stacked = np.stack([by_expert[e] for e in range(len(by_expert))])
        yield f"blk.{index}.{QWEN35_NAMES[f'mlp.experts.{kind}']}", stacked


def _qwen35_array(name: str, w: np.ndarray, config: dict) -> np.ndarray:
    """A Qwen3.5 tensor as the converter writes it: norms + 1 (zero-centred) but the DeltaNet's
    gated one, A as -exp(A_log), conv1d squeezed, and the DeltaNet's V heads (of in_proj_qkv's V
    rows, z, a, b, A, dt_bias, conv1d's V channels, out_proj's columns) from grouped by K head to
    tiled (every K head's first V head, then every second...), the order ggml's broadcast reads."""
    import torch

    k_heads, v_heads = config["linear_num_key_heads"], config["linear_num_value_heads"]
    qk_rows = 2 * k_heads * config["linear_key_head_dim"]
    v_dim = config["linear_value_head_dim"]

    def tiled(w: np.ndarray, axis: int, head_dim: int) -> np.ndarray:
        w = np.moveaxis(w, axis, 0)
        grouped = w.reshape(k_heads, v_heads // k_heads, head_dim, *w.shape[1:])
        return np.moveaxis(grouped.swapaxes(0, 1).reshape(w.shape), 0, axis)

    if name.endswith("norm.weight") and name != "linear_attn.norm.weight":
        return w + 1
    if name in ("linear_attn.in_proj_qkv.weight", "linear_attn.conv1d.weight"):
        w = w.squeeze() if "conv1d" in name else w  # conv1d's [channels, 1, K]
        return np.concatenate([w[:qk_rows], tiled(w[qk_rows:], 0, v_dim)])
    if name == "linear_attn.in_proj_z.weight":
        return tiled(w, 0, v_dim)
    if name in ("linear_attn.in_proj_a.weight", "linear_attn.in_proj_b.weight", "linear_attn.dt_bias"):
        return tiled(w, 0, 1)
    if name == "linear_attn.A_log":  # torch's exp, the converter's (numpy's differs in the last bit)
        return -torch.exp(torch.from_numpy(tiled(w, 0, 1))).numpy()
    if name == "linear_attn.out_proj.weight":
        return tiled(w, 1, v_dim)
    return w


def llama3_factors(scaling: dict, head_dim: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf for rope_type llama3: each frequency's divisor."""
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old = scaling["original_max_position_embeddings"]
    freqs = 1.0 / (scaling["rope_theta"] ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
    factors = []
    for freq in freqs:
        wavelen = 2 * np.pi / freq
        if wavelen < old / high:
            factors.append(1.0)
        elif wavelen > old / low:
            factors.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, np.float32)


def _permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
