"""Checkpoints: one in-memory weight format that every file format loads into.

A `Checkpoint` is the model's `ModelSpec` and its tensors under canonical names, matrices in
[out, in] layout, Q/K rows in HuggingFace (rotate-half RoPE) order: fp32 numpy arrays, or a GGUF's
matrices kept in their file's format (`blocks`, agent/model/quantized.py; `matrix()` dequantizes one):

    embed [V, D], final_norm [D], lm_head [V, D] (absent when tied),
    layers.{i}.attn_norm [D], wq [H*hd, D], wk [KV*hd, D], wv [KV*hd, D], (bq, bk, bv with QKV bias),
    wo [D, H*hd], ffn_norm [D], w_gate [F, D], w_up [F, D], w_down [D, F],
    (q_norm, k_norm [hd] with QK-norm; post_attn_norm, post_ffn_norm [D] with post-norms: Gemma 3's)

Norm weights multiply as they are: a Gemma checkpoint's (1 + w) is formed at load (llama.cpp's
converter has already added the 1 in a GGUF file).

The readers live in agent/model/formats/ (GGUF files, HuggingFace directories, MindSpore .ckpt
files), with load_checkpoint() choosing one by the path.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import numpy as np

from agent.model.quantized import BlockMatrix
from agent.model.spec import ModelSpec

T = TypeVar("T")
Progress = Callable[[Iterable[T]], Iterable[T]]  # wraps the tensor loop (e.g. tqdm); identity by default


class CheckpointError(Exception):
    """A checkpoint that cannot be loaded; the message says which file and why."""


@dataclass
class Checkpoint:
    spec: ModelSpec
    tensors: dict[str, np.ndarray]  # float32
    source: Path
    format: str  # "gguf", "safetensors" or "ckpt"
    # GGUF matrices in a format the CPU kernels multiply, kept packed in that format (not in tensors)
    blocks: dict[str, BlockMatrix] = field(default_factory=dict)

    def matrix(self, name: str) -> np.ndarray:
        """A tensor as float32, a kept matrix dequantized (a new array each call)."""
        kept = self.blocks.get(name)
        return self.tensors[name] if kept is None else kept.dequantize()

    def shape(self, name: str) -> tuple[int, ...] | None:
        kept = self.blocks.get(name)
        if kept is not None:
            return kept.shape
        tensor = self.tensors.get(name)
        return None if tensor is None else tuple(tensor.shape)

    def weight_bytes(self) -> int:
        """The memory the weights take as loaded."""
        return sum(t.nbytes for t in self.tensors.values()) + sum(b.nbytes for b in self.blocks.values())


LAYER_TENSORS = ("attn_norm", "wq", "wk", "wv", "wo", "ffn_norm", "w_gate", "w_up", "w_down")
BIAS_TENSORS = ("bq", "bk", "bv")
QK_NORM_TENSORS = ("q_norm", "k_norm")
POST_NORM_TENSORS = ("post_attn_norm", "post_ffn_norm")


def no_progress(items: Iterable[T]) -> Iterable[T]:
    return items


def expected_shapes(spec: ModelSpec) -> Iterator[tuple[str, tuple[int, ...]]]:
    d, hd, f, v = spec.hidden_size, spec.head_dim, spec.intermediate_size, spec.vocab_size
    q, kv = spec.num_heads * hd, spec.num_kv_heads * hd
    yield "embed", (v, d)
    yield "final_norm", (d,)
    if not spec.tied_embeddings:
        yield "lm_head", (v, d)
    shapes = {
        "attn_norm": (d,),
        "wq": (q, d),
        "wk": (kv, d),
        "wv": (kv, d),
        "wo": (d, q),
        "ffn_norm": (d,),
        "w_gate": (f, d),
        "w_up": (f, d),
        "w_down": (d, f),
        "bq": (q,),
        "bk": (kv,),
        "bv": (kv,),
        "q_norm": (hd,),
        "k_norm": (hd,),
        "post_attn_norm": (d,),
        "post_ffn_norm": (d,),
    }
    names = LAYER_TENSORS + (BIAS_TENSORS if spec.qkv_bias else ())
    names += (QK_NORM_TENSORS if spec.qk_norm else ()) + (POST_NORM_TENSORS if spec.post_norms else ())
    for i in range(spec.num_layers):
        for name in names:
            yield f"layers.{i}.{name}", shapes[name]


def validate(ckpt: Checkpoint) -> None:
    spec = ckpt.spec
    embed = ckpt.shape("embed")
    if embed is not None and embed[0] != spec.vocab_size:
        raise CheckpointError(
            f"{ckpt.source}: vocab/weight mismatch: the embedding has {embed[0]} rows "
            f"but the vocabulary size is {spec.vocab_size}"
        )
    if spec.num_heads % spec.num_kv_heads:
        raise CheckpointError(
            f"{ckpt.source}: {spec.num_heads} attention heads are not a "
            f"multiple of {spec.num_kv_heads} KV heads"
        )
    for name, shape in expected_shapes(spec):
        found = ckpt.shape(name)
        if found is None:
            raise CheckpointError(f"{ckpt.source}: missing tensor {name}")
        if found != shape:
            raise CheckpointError(f"{ckpt.source}: tensor {name} has shape {found}, expected {shape}")
