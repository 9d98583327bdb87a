"""Tiny random LLaMA/Qwen2 checkpoints in HuggingFace layout, written by the tests themselves."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + "
          "message['content'] + '<|im_end|>' + '\n' }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CORPUS = [
    "The capital of France is Paris. The quick brown fox jumps over the lazy dog.",
    "北京是中国的首都。你好，世界！ 东京是日本的首都。",
    "Numbers 0123456789 and symbols !?#%&*()[]{} and tabs\tand newlines\n\n.",
    "emoji 😀 🎉 🚀 and accents café naïve résumé",
] * 20


def write_tokenizer(directory: Path, vocab_size: int = 400) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tokenizer.train_from_iterator(CORPUS, trainer)
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": CHATML, "bos_token": None, "eos_token": "<|im_end|>"}))
    return tokenizer


def write_tiny_checkpoint(directory: Path, model_type: str = "llama", *, seed: int = 0,
                          layers: int = 2, hidden: int = 64, heads: int = 4, kv_heads: int = 2,
                          intermediate: int = 128, tied: bool = False,
                          extra_config: dict | None = None) -> Path:
    """config.json + model.safetensors + tokenizer files; weights scaled so logits spread widely
    (near-ties would make greedy comparisons flaky)."""
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer = write_tokenizer(directory)
    vocab = tokenizer.get_vocab_size()
    rng = np.random.default_rng(seed)
    head_dim = hidden // heads

    def matrix(out_dim: int, in_dim: int) -> np.ndarray:
        return (rng.standard_normal((out_dim, in_dim)) / np.sqrt(in_dim)).astype(np.float32)

    def norm(dim: int) -> np.ndarray:
        return (1.0 + 0.1 * rng.standard_normal(dim)).astype(np.float32)

    tensors = {"model.embed_tokens.weight": rng.standard_normal((vocab, hidden)).astype(np.float32),
               "model.norm.weight": norm(hidden)}
    if not tied:
        tensors["lm_head.weight"] = matrix(vocab, hidden) * 4
    for i in range(layers):
        p = f"model.layers.{i}."
        tensors.update({
            p + "input_layernorm.weight": norm(hidden),
            p + "self_attn.q_proj.weight": matrix(heads * head_dim, hidden) * 2,
            p + "self_attn.k_proj.weight": matrix(kv_heads * head_dim, hidden) * 2,
            p + "self_attn.v_proj.weight": matrix(kv_heads * head_dim, hidden),
            p + "self_attn.o_proj.weight": matrix(hidden, heads * head_dim),
            p + "post_attention_layernorm.weight": norm(hidden),
            p + "mlp.gate_proj.weight": matrix(intermediate, hidden),
            p + "mlp.up_proj.weight": matrix(intermediate, hidden),
            p + "mlp.down_proj.weight": matrix(hidden, intermediate)})
        if model_type == "qwen2":
            for name, dim in (("q", heads), ("k", kv_heads), ("v", kv_heads)):
                tensors[p + f"self_attn.{name}_proj.bias"] = \
                    (0.5 * rng.standard_normal(dim * head_dim)).astype(np.float32)
    save_file(tensors, str(directory / "model.safetensors"))
    config = {"model_type": model_type, "hidden_size": hidden, "num_attention_heads": heads,
              "num_key_value_heads": kv_heads, "num_hidden_layers": layers,
              "intermediate_size": intermediate, "vocab_size": vocab, "rope_theta": 10000.0,
              "rms_norm_eps": 1e-6, "tie_word_embeddings": tied, "max_position_embeddings": 512,
              "bos_token_id": None, "eos_token_id": tokenizer.token_to_id("<|im_end|>")}
    config.update(extra_config or {})
    (directory / "config.json").write_text(json.dumps(config))
    return directory
