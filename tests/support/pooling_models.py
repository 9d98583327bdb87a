"""Tiny pooling models of the Qwen3 family with Qwen3's real vocabulary (qwen2), built by
transformers with random float32 weights (hf_reference.build): an embedder as Qwen3-Embedding is
published (a Hugging Face directory with sentence-transformers' modules.json: last-token pooling,
then normalization; and the GGUF llama.cpp's converter writes of it: pooling_type 3, EOS added to
each input) and a reranker as Qwen3-Reranker's GGUF is written (pooling_type 4, the labels yes and
no, the `rerank` template)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

import hf_reference as hf
from agent.model.tokenizer import load_tokenizer
from server.pooling import RERANK_TEMPLATE

FAMILY = "qwen3"


def write_embedder(directory: Path, seed: int = 0):
    """The embedder's directory and GGUF (directory / "embedder.gguf"), and its transformers model."""
    model = hf.build(FAMILY, directory, seed=seed)
    load_tokenizer(hf.vocabulary_path(FAMILY)).save(directory)
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"},
    ]
    (directory / "modules.json").write_text(json.dumps(modules))
    (directory / "1_Pooling").mkdir()
    pooling = {"word_embedding_dimension": 64, "pooling_mode_lasttoken": True, "include_prompt": True}
    (directory / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    (directory / "2_Normalize").mkdir()
    extra = {f"{FAMILY}.pooling_type": 3, "tokenizer.ggml.add_eos_token": True}
    gguf = hf.write_gguf(directory, directory / "embedder.gguf", FAMILY, extra)
    return directory, gguf, model


def write_reranker(directory: Path, seed: int = 1):
    """The reranker's GGUF and its transformers model."""
    model = hf.build(FAMILY, directory, seed=seed)
    extra = {
        f"{FAMILY}.pooling_type": 4,
        f"{FAMILY}.classifier.output_labels": ["yes", "no"],
        "tokenizer.chat_template.rerank": RERANK_TEMPLATE,
    }
    return hf.write_gguf(directory, directory / "reranker.gguf", FAMILY, extra), model


# An EmbeddingGemma-shaped encoder: Gemma 3's layers with bidirectional attention (two local layers
# whose window reaches 8 positions either side, transformers' sliding_window 16 halved, then a
# global one), mean pooling, two dense projections and normalization, as sentence-transformers
# saves EmbeddingGemma; with a real SentencePiece vocabulary (llama.cpp's llama-spm suite file)
GEMMA_VOCABULARY = "llama-spm"
GEMMA_ENCODER = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "query_pre_attn_scalar": 32,
    "sliding_window": 16,
    "layer_types": ["sliding_attention", "sliding_attention", "full_attention"],
    "use_bidirectional_attention": True,
    "max_position_embeddings": 512,
}
GEMMA_PROJECTION = 96  # the first dense projection's width (EmbeddingGemma's: 3072 of 768)
# llama.cpp's names of Gemma 3's tensors after "layers.<i>."; norms hold 1 + w in the file
GEMMA_GGUF_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "post_attention_layernorm.weight": "post_attention_norm.weight",
    "pre_feedforward_layernorm.weight": "ffn_norm.weight",
    "post_feedforward_layernorm.weight": "post_ffw_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def write_gemma_embedder(directory: Path, seed: int = 2):
    """The encoder as sentence-transformers saves it (directory / "sentence-transformers") and as
    llama.cpp's converter writes it with --sentence-transformers-dense-modules (directory /
    "encoder.gguf": architecture gemma-embedding, pooling_type 1, dense_2 and dense_3), and the
    SentenceTransformer."""
    import torch
    import transformers
    from sentence_transformers import SentenceTransformer, models

    fields = hf.vocabulary_fields("mistral")  # the llama-spm suite file's
    tokens = len(fields["tokenizer.ggml.tokens"])
    special = {k: fields[f"tokenizer.ggml.{k}"] for k in ("bos_token_id", "eos_token_id")}
    config = transformers.Gemma3TextConfig(vocab_size=tokens, pad_token_id=0, **special, **GEMMA_ENCODER)
    torch.manual_seed(seed)
    encoder = transformers.AutoModel.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, weight in encoder.named_parameters():
            if "norm" in name:  # Gemma's RMSNorm multiplies by 1 + w
                weight.normal_(0, 0.1)
            elif name == "embed_tokens.weight":
                weight.normal_(0, 1)
            else:
                weight.normal_(0, weight.shape[-1] ** -0.5)
    transformer_dir = directory / "transformer"
    encoder.save_pretrained(transformer_dir, safe_serialization=True)
    load_tokenizer(hf.vocabulary_path("mistral")).save(transformer_dir)
    # transformers would take Gemma's tokenizer class from the config (padding with a <pad> the
    # vocabulary lacks): the tokenizer.json as it is, padded with <unk> (id 0, the config's pad id)
    tokenizer_config = json.loads((transformer_dir / "tokenizer_config.json").read_text())
    tokenizer_config |= {"tokenizer_class": "PreTrainedTokenizerFast", "pad_token": "<unk>"}
    (transformer_dir / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    hidden = GEMMA_ENCODER["hidden_size"]
    dense = [
        models.Dense(hidden, GEMMA_PROJECTION, bias=False, activation_function=torch.nn.Identity()),
        models.Dense(GEMMA_PROJECTION, hidden, bias=False, activation_function=torch.nn.Identity()),
    ]
    with torch.no_grad():
        for layer in dense:
            layer.linear.weight.normal_(0, layer.linear.weight.shape[-1] ** -0.5)
    st = SentenceTransformer(
        modules=[
            models.Transformer(str(transformer_dir)),
            models.Pooling(hidden, "mean"),
            *dense,
            models.Normalize(),
        ],
        device="cpu",
    )
    st.save(str(directory / "sentence-transformers"))
    gguf_path = _write_gemma_gguf(
        encoder, config, [d.linear.weight for d in dense], directory / "encoder.gguf"
    )
    return directory / "sentence-transformers", gguf_path, st


def _write_gemma_gguf(encoder, config, projections, path: Path) -> Path:
    import gguf

    arch = "gemma-embedding"
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name("tiny-embeddinggemma")
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    writer.add_rope_freq_base(config.rope_parameters["full_attention"]["rope_theta"])
    writer.add_float32(
        f"{arch}.rope.freq_base_swa", config.rope_parameters["sliding_attention"]["rope_theta"]
    )
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_sliding_window(GEMMA_ENCODER["sliding_window"])  # config.json's, before halving
    writer.add_uint32(f"{arch}.attention.sliding_window_pattern", 3)  # every third layer global
    writer.add_uint32(f"{arch}.pooling_type", 1)  # mean
    for name, matrix in zip(("dense_2", "dense_3"), projections):
        writer.add_uint32(f"{arch}.{name}_feat_in", matrix.shape[1])
        writer.add_uint32(f"{arch}.{name}_feat_out", matrix.shape[0])
    hf.add_vocabulary(writer, hf.vocabulary_fields("mistral"))
    for hf_name, tensor in encoder.state_dict().items():
        array = tensor.detach().numpy().astype(np.float32)
        if hf_name == "embed_tokens.weight":
            name = "token_embd.weight"
        elif hf_name == "norm.weight":
            name = "output_norm.weight"
        else:
            index, rest = hf_name[len("layers.") :].split(".", 1)
            name = f"blk.{index}.{GEMMA_GGUF_NAMES[rest]}"
        if name.endswith("norm.weight"):
            array = array + 1  # the converter's norm shift
        writer.add_tensor(name, np.ascontiguousarray(array))
    for name, matrix in zip(("dense_2", "dense_3"), projections):
        writer.add_tensor(f"{name}.weight", np.ascontiguousarray(matrix.detach().numpy(), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
