"""Tiny random checkpoints written by the tests themselves: HuggingFace directories (Llama, Qwen2,
InternLM2; one file or shards with an index) and GGUF files (F32 to Q6_K) of the same weights, and a
tiny Gemma-3-shaped GGUF."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + "
    "message['content'] + '<|im_end|>' + '\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CORPUS = [
    "The capital of France is Paris. The quick brown fox jumps over the lazy dog.",
    "北京是中国的首都。你好，世界！ 东京是日本的首都。",
    "Numbers 0123456789 and symbols !?#%&*()[]{} and tabs\tand newlines\n\n.",
    "emoji 😀 🎉 🚀 and accents café naïve résumé",
] * 20


def write_tokenizer(directory: Path, vocab_size: int = 400, specials: tuple[str, ...] = ()) -> Tokenizer:
    """A byte-level BPE trained on CORPUS, with SPECIALS and `specials` as special tokens."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIALS + list(specials),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(CORPUS, trainer)
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(
        json.dumps({"chat_template": CHATML, "bos_token": None, "eos_token": "<|im_end|>"})
    )
    return tokenizer


def write_tiny_checkpoint(
    directory: Path,
    model_type: str = "llama",
    *,
    seed: int = 0,
    layers: int = 2,
    hidden: int = 64,
    heads: int = 4,
    kv_heads: int = 2,
    intermediate: int = 128,
    tied: bool = False,
    shards: int = 1,
    extra_config: dict | None = None,
    specials: tuple[str, ...] = (),
) -> Path:
    """config.json + model.safetensors (or `shards` files and model.safetensors.index.json) +
    tokenizer files; weights scaled so logits spread widely (near-ties would make greedy
    comparisons flaky). model_type "internlm2" packs Q/K/V into wqkv under InternLM2's names, "phi3"
    Q/K/V into qkv_proj and gate/up into gate_up_proj; "qwen3" adds QK-norm weights and a head size of
    hidden / heads x 1.5 (not hidden / heads); "mistral" is Llama's. `specials`: more special tokens
    in the vocabulary (Mistral's control tokens)."""
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer = write_tokenizer(directory, specials=specials)
    vocab = tokenizer.get_vocab_size()
    rng = np.random.default_rng(seed)
    head_dim = hidden // heads * 3 // 2 if model_type == "qwen3" else hidden // heads

    def matrix(out_dim: int, in_dim: int) -> np.ndarray:
        return (rng.standard_normal((out_dim, in_dim)) / np.sqrt(in_dim)).astype(np.float32)

    def norm(dim: int) -> np.ndarray:
        return (1.0 + 0.1 * rng.standard_normal(dim)).astype(np.float32)

    tensors = {
        "model.embed_tokens.weight": rng.standard_normal((vocab, hidden)).astype(np.float32),
        "model.norm.weight": norm(hidden),
    }
    if not tied:
        tensors["lm_head.weight"] = matrix(vocab, hidden) * 4
    for i in range(layers):
        p = f"model.layers.{i}."
        tensors.update(
            {
                p + "input_layernorm.weight": norm(hidden),
                p + "self_attn.q_proj.weight": matrix(heads * head_dim, hidden) * 2,
                p + "self_attn.k_proj.weight": matrix(kv_heads * head_dim, hidden) * 2,
                p + "self_attn.v_proj.weight": matrix(kv_heads * head_dim, hidden),
                p + "self_attn.o_proj.weight": matrix(hidden, heads * head_dim),
                p + "post_attention_layernorm.weight": norm(hidden),
                p + "mlp.gate_proj.weight": matrix(intermediate, hidden),
                p + "mlp.up_proj.weight": matrix(intermediate, hidden),
                p + "mlp.down_proj.weight": matrix(hidden, intermediate),
            }
        )
        if model_type == "qwen3":
            tensors[p + "self_attn.q_norm.weight"] = norm(head_dim)
            tensors[p + "self_attn.k_norm.weight"] = norm(head_dim)
        if model_type == "qwen2":
            for name, dim in (("q", heads), ("k", kv_heads), ("v", kv_heads)):
                tensors[p + f"self_attn.{name}_proj.bias"] = (
                    0.5 * rng.standard_normal(dim * head_dim)
                ).astype(np.float32)
    if model_type == "internlm2":
        tensors = _internlm2_layout(tensors, layers, heads // kv_heads, kv_heads, head_dim)
    if model_type == "phi3":
        tensors = _phi3_layout(tensors, layers)
    _save_shards(tensors, directory, shards)
    config = {
        "model_type": model_type,
        "hidden_size": hidden,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "num_hidden_layers": layers,
        "head_dim": head_dim,
        "intermediate_size": intermediate,
        "vocab_size": vocab,
        "rope_theta": 10000.0,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": tied,
        "max_position_embeddings": 512,
        "bos_token_id": None,
        "eos_token_id": tokenizer.token_to_id("<|im_end|>"),
    }
    config.update(extra_config or {})
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def _internlm2_layout(tensors: dict, layers: int, group: int, kv_heads: int, head_dim: int) -> dict:
    renames = {"model.embed_tokens.weight": "model.tok_embeddings.weight", "lm_head.weight": "output.weight"}
    layer_renames = {
        "input_layernorm": "attention_norm",
        "self_attn.o_proj": "attention.wo",
        "post_attention_layernorm": "ffn_norm",
        "mlp.gate_proj": "feed_forward.w1",
        "mlp.up_proj": "feed_forward.w3",
        "mlp.down_proj": "feed_forward.w2",
    }
    out = {
        renames.get(k, k): v
        for k, v in tensors.items()
        if "self_attn.q_proj" not in k and "self_attn.k_proj" not in k and "self_attn.v_proj" not in k
    }
    for old, new in layer_renames.items():
        for i in range(layers):
            key = f"model.layers.{i}.{old}.weight"
            out[f"model.layers.{i}.{new}.weight"] = out.pop(key)
    for i in range(layers):
        p = f"model.layers.{i}.self_attn."
        q = tensors[p + "q_proj.weight"].reshape(kv_heads, group, head_dim, -1)
        k = tensors[p + "k_proj.weight"].reshape(kv_heads, 1, head_dim, -1)
        v = tensors[p + "v_proj.weight"].reshape(kv_heads, 1, head_dim, -1)
        out[f"model.layers.{i}.attention.wqkv.weight"] = np.ascontiguousarray(
            np.concatenate([q, k, v], axis=1).reshape(-1, q.shape[-1])
        )
    return out


def _phi3_layout(tensors: dict, layers: int) -> dict:
    """Phi-3's packed matrices: Q, K, V rows one above the other, the gate's above up's."""
    for i in range(layers):
        p = f"model.layers.{i}."
        tensors[p + "self_attn.qkv_proj.weight"] = np.concatenate(
            [tensors.pop(p + f"self_attn.{name}_proj.weight") for name in "qkv"]
        )
        tensors[p + "mlp.gate_up_proj.weight"] = np.concatenate(
            [tensors.pop(p + "mlp.gate_proj.weight"), tensors.pop(p + "mlp.up_proj.weight")]
        )
    return tensors


def _save_shards(tensors: dict, directory: Path, shards: int) -> None:
    if shards == 1:
        save_file(tensors, str(directory / "model.safetensors"))
        return
    names = sorted(tensors)
    weight_map = {}
    for s in range(shards):
        file = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        part = names[s::shards]
        save_file({n: tensors[n] for n in part}, str(directory / file))
        weight_map.update(dict.fromkeys(part, file))
    (directory / "model.safetensors.index.json").write_text(
        json.dumps(
            {"metadata": {"total_size": sum(t.nbytes for t in tensors.values())}, "weight_map": weight_map}
        )
    )


# ------------------------------------------------------------------------------------------ GGUF

GGUF_MODEL_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
GGUF_NAMES = {  # a layer's, after "model.layers.{i}." ("blk.{i}." in GGUF)
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
}


def _llamacpp_permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf permute: rotate-half rows -> interleaved pairs."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _random_blocks(rows: np.ndarray, qtype, rng) -> np.ndarray:
    """The gguf package cannot quantize to Q4_K/Q6_K (or Q8_1), so these tensors get random block
    contents, with sane scales for the K types: what the loader must do is dequantize whatever
    blocks it finds, like llama.cpp."""
    import gguf

    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    n_blocks = rows.size // block_size
    blocks = rng.integers(0, 256, size=(n_blocks, type_size), dtype=np.uint8)
    if qtype == gguf.GGMLQuantizationType.Q4_K:  # d, dmin (f16) lead the block
        blocks[:, 0:2] = np.full(n_blocks, 2e-4, np.float16).view(np.uint8).reshape(-1, 2)
        blocks[:, 2:4] = np.full(n_blocks, 1e-4, np.float16).view(np.uint8).reshape(-1, 2)
    elif qtype == gguf.GGMLQuantizationType.Q6_K:  # d (f16) ends the block
        blocks[:, -2:] = np.full(n_blocks, 3e-5, np.float16).view(np.uint8).reshape(-1, 2)
    return blocks.reshape(rows.shape[0], -1)


def _add_tokenizer(writer, hf_dir: Path, config: dict) -> None:
    """The HuggingFace tokenizer as GGUF vocabulary (the added tokens as control tokens) and merges,
    with the eos token and the chat template."""
    tokenizer = json.loads((hf_dir / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    specials = {t["content"]: t["id"] for t in tokenizer["added_tokens"]}
    tokens = sorted({**vocab, **specials}.items(), key=lambda kv: kv[1])
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list([t for t, _ in tokens])
    writer.add_token_types([3 if t in specials else 1 for t, _ in tokens])
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in tokenizer["model"]["merges"]])
    writer.add_eos_token_id(config["eos_token_id"])
    writer.add_chat_template(json.loads((hf_dir / "tokenizer_config.json").read_text())["chat_template"])


def _gguf_name(hf_name: str) -> str:
    """llama.cpp's name of a HuggingFace tensor."""
    if hf_name in GGUF_MODEL_NAMES:
        return GGUF_MODEL_NAMES[hf_name]
    index, rest = hf_name[len("model.layers.") :].split(".", 1)
    return f"blk.{index}.{GGUF_NAMES[rest]}"


def _add_quantized(writer, name: str, array: np.ndarray, qtype_name: str, rng) -> None:
    """A matrix whose rows fit qtype_name's blocks: random blocks for the types gguf cannot quantize
    to, F16 as float16, the rest quantized by gguf."""
    import gguf

    qtype = gguf.GGMLQuantizationType[qtype_name]
    if qtype_name in ("Q4_K", "Q6_K", "Q8_1"):
        writer.add_tensor(name, _random_blocks(array, qtype, rng), raw_dtype=qtype)
    elif qtype_name == "F16":
        writer.add_tensor(name, array.astype(np.float16))
    else:
        writer.add_tensor(name, gguf.quants.quantize(array, qtype), raw_dtype=qtype)


def write_tiny_gguf(
    hf_dir: Path, path: Path, qtype_name: str = "F32", seed: int = 0, embedding_qtype: str | None = None
) -> Path:
    """The HuggingFace checkpoint in `hf_dir` (llama or qwen2) as a GGUF file in llama.cpp's layout:
    2-D weights stored as `qtype_name` where their rows fit its blocks (F32 otherwise, as llama.cpp
    does), the token embedding as `embedding_qtype` if given (the default model's is Q8_0 with Q4_1
    layers), norms F32, Q/K rows permuted for llama, the tokenizer as GGUF vocabulary + merges."""
    import gguf
    from safetensors.numpy import load_file

    config = json.loads((hf_dir / "config.json").read_text())
    arch = config["model_type"]
    qtype = gguf.GGMLQuantizationType[qtype_name]
    block_size, _ = gguf.GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    tensors = load_file(str(hf_dir / "model.safetensors"))
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name("tiny")
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(config["rope_theta"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_vocab_size(config["vocab_size"])
    scaling = config.get("rope_scaling")
    if scaling and scaling.get("type", scaling.get("rope_type")) == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(scaling["factor"])

    _add_tokenizer(writer, hf_dir, config)

    for hf_name, array in sorted(tensors.items()):
        name = _gguf_name(hf_name)
        if arch == "llama" and ".attn_q." in name:
            array = _llamacpp_permute(array, heads)
        elif arch == "llama" and ".attn_k." in name:
            array = _llamacpp_permute(array, kv_heads)
        array = np.ascontiguousarray(array, np.float32)
        if name == "token_embd.weight" and embedding_qtype is not None:
            embedding = gguf.GGMLQuantizationType[embedding_qtype]
            writer.add_tensor(name, gguf.quants.quantize(array, embedding), raw_dtype=embedding)
        elif array.ndim == 2 and array.shape[1] % block_size == 0 and qtype_name != "F32":
            _add_quantized(writer, name, array, qtype_name, rng)
        else:
            writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


# ------------------------------------------------------------------------------------ Gemma 3

GEMMA_WINDOW = 16


def write_tiny_gemma(path: Path, vocabulary: Path, seed: int = 3) -> Path:
    """A Gemma 3 GGUF of hidden 128, 4 query heads and 1 KV head of 64 (not hidden / heads), FFN 256,
    6 layers (5 local with a sliding window of GEMMA_WINDOW, the last global), QK-norm and four norms
    a layer; the real 270M file's weight formats (Q5_0, Q8_0, Q4_K, Q6_K) and its SentencePiece
    vocabulary (`vocabulary`: that file) cut to its first 1,024 tokens and ASCII's characters; a
    tied Q8_0 embedding of weights near 1 (the LM head: logits far apart, so greedy tokens are no
    near-ties)."""
    from tools.make_gguf import Shape, mix, write_random_gguf

    shape = Shape(
        128, 6, 256, 4, 1, arch="gemma3", head_dim=64, window=GEMMA_WINDOW, context=512, rope_base=1e6
    )
    return write_random_gguf(path, shape, mix("gemma"), vocabulary, seed, vocab_limit=1024, embed_scale=1.0)
