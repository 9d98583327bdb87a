"""Checkpoints: one in-memory weight format that every file format loads into.

A `Checkpoint` is the model's `ModelSpec` and fp32 numpy tensors under canonical names, matrices in
[out, in] layout, Q/K rows in HuggingFace (rotate-half RoPE) order:

    embed [V, D], final_norm [D], lm_head [V, D] (absent when tied),
    layers.{i}.attn_norm [D], wq [H*hd, D], wk [KV*hd, D], wv [KV*hd, D], (bq, bk, bv with QKV bias),
    wo [D, H*hd], ffn_norm [D], w_gate [F, D], w_up [F, D], w_down [D, F]

The readers live in agent/formats/: GGUF files, HuggingFace directories, MindSpore .ckpt files.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Iterator, TypeVar

import numpy as np

from agent.model_spec import ModelSpec
from agent.quantized import Q4Matrix

T = TypeVar("T")
Progress = Callable[[Iterable[T]], Iterable[T]]  # wraps the tensor loop (e.g. tqdm); identity by default


class CheckpointError(Exception):
    """A checkpoint that cannot be loaded; the message says which file and why."""


@dataclass
class Checkpoint:
    spec: ModelSpec
    tensors: dict[str, np.ndarray]
    source: Path
    format: str  # "gguf", "safetensors" or "ckpt"
    # GGUF Q4_1 layer matrices also kept quantized (agent/quantized.py), same names and row order
    q4: dict[str, "Q4Matrix"] = field(default_factory=dict)


LAYER_TENSORS = ("attn_norm", "wq", "wk", "wv", "wo", "ffn_norm", "w_gate", "w_up", "w_down")
BIAS_TENSORS = ("bq", "bk", "bv")


def _no_progress(items: Iterable[T]) -> Iterable[T]:
    return items


def load_checkpoint(path: str | Path, progress: Progress = _no_progress) -> Checkpoint:
    """Load a `.gguf` file, a HuggingFace directory (config.json + *.safetensors, sharded or not),
    or a MindSpore `.ckpt` (a file, or a directory holding model.ckpt, as tools.convert writes)."""
    from agent.formats import gguf_file, hf_dir, ms_ckpt

    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"model path does not exist: {path}")
    if path.is_file() and path.suffix == ".gguf":
        checkpoint = gguf_file.load(path, progress)
    elif path.is_file() and path.suffix == ".ckpt":
        checkpoint = ms_ckpt.load(path, progress)
    elif path.is_dir() and (path / "config.json").is_file():
        checkpoint = hf_dir.load(path, progress)
    elif path.is_dir() and (path / ms_ckpt.FILE_NAME).is_file():
        checkpoint = ms_ckpt.load(path / ms_ckpt.FILE_NAME, progress)
    else:
        raise CheckpointError(f"unrecognised model path {path}: expected a .gguf file, a .ckpt file, "
                              f"or a directory with config.json or {ms_ckpt.FILE_NAME}")
    validate(checkpoint)
    return checkpoint


def expected_shapes(spec: ModelSpec) -> Iterator[tuple[str, tuple[int, ...]]]:
    d, hd, f, v = spec.hidden_size, spec.head_dim, spec.intermediate_size, spec.vocab_size
    q, kv = spec.num_heads * hd, spec.num_kv_heads * hd
    yield "embed", (v, d)
    yield "final_norm", (d,)
    if not spec.tied_embeddings:
        yield "lm_head", (v, d)
    shapes = {"attn_norm": (d,), "wq": (q, d), "wk": (kv, d), "wv": (kv, d), "wo": (d, q),
              "ffn_norm": (d,), "w_gate": (f, d), "w_up": (f, d), "w_down": (d, f),
              "bq": (q,), "bk": (kv,), "bv": (kv,)}
    names = LAYER_TENSORS + (BIAS_TENSORS if spec.qkv_bias else ())
    for i in range(spec.num_layers):
        for name in names:
            yield f"layers.{i}.{name}", shapes[name]


def validate(ckpt: Checkpoint) -> None:
    spec = ckpt.spec
    embed = ckpt.tensors.get("embed")
    if embed is not None and embed.shape[0] != spec.vocab_size:
        raise CheckpointError(
            f"{ckpt.source}: vocab/weight mismatch: the embedding has {embed.shape[0]} rows "
            f"but the vocabulary size is {spec.vocab_size}")
    if spec.num_heads % spec.num_kv_heads:
        raise CheckpointError(f"{ckpt.source}: {spec.num_heads} attention heads are not a "
                              f"multiple of {spec.num_kv_heads} KV heads")
    for name, shape in expected_shapes(spec):
        tensor = ckpt.tensors.get(name)
        if tensor is None:
            raise CheckpointError(f"{ckpt.source}: missing tensor {name}")
        if tensor.shape != shape:
            raise CheckpointError(
                f"{ckpt.source}: tensor {name} has shape {tuple(tensor.shape)}, expected {shape}")


def unpermute_qk(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's interleaved-RoPE row order: rows (head, pair, 2) -> (head, 2, pair)."""
    out_dim = w.shape[0]
    rest = w.shape[1:]
    head_dim = out_dim // n_heads
    return w.reshape(n_heads, head_dim // 2, 2, *rest).swapaxes(1, 2).reshape(out_dim, *rest)


def split_packed_qkv(w: np.ndarray, kv_heads: int, group: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """InternLM2's wqkv rows are (kv head, [group queries, key, value], head_dim) -> wq, wk, wv."""
    rest = w.shape[1:]
    head_dim = w.shape[0] // (kv_heads * (group + 2))
    blocks = w.reshape(kv_heads, group + 2, head_dim, *rest)
    return (blocks[:, :group].reshape(kv_heads * group * head_dim, *rest),
            blocks[:, group].reshape(kv_heads * head_dim, *rest),
            blocks[:, group + 1].reshape(kv_heads * head_dim, *rest))
