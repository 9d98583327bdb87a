"""Tiny pooling models of the Qwen3 family with Qwen3's real vocabulary (qwen2), built by
transformers with random float32 weights (hf_reference.build): an embedder as Qwen3-Embedding is
published (a Hugging Face directory with sentence-transformers' modules.json: last-token pooling,
then normalization; and the GGUF llama.cpp's converter writes of it: pooling_type 3, EOS added to
each input) and a reranker as Qwen3-Reranker's GGUF is written (pooling_type 4, the labels yes and
no, the `rerank` template)."""

from __future__ import annotations

import json
from pathlib import Path

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
