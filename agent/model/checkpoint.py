"""Checkpoints: one in-memory weight format that every file format loads into.

A `Checkpoint` is the model's `ModelSpec` and fp32 numpy tensors under canonical names, matrices in
[out, in] layout, Q/K rows in HuggingFace (rotate-half RoPE) order:

    embed [V, D], final_norm [D], lm_head [V, D] (absent when tied),
    layers.{i}.attn_norm [D], wq [H*hd, D], wk [KV*hd, D], wv [KV*hd, D], (bq, bk, bv with QKV bias),
    wo [D, H*hd], ffn_norm [D], w_gate [F, D], w_up [F, D], w_down [D, F]

The readers live in agent/model/formats/ (GGUF files, HuggingFace directories, MindSpore .ckpt
files), with load_checkpoint() choosing one by the path.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import numpy as np

from agent.model.quantized import Q4Matrix, Q8Matrix
from agent.model.spec import ModelSpec

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
    q4: dict[str, Q4Matrix] = field(default_factory=dict)
    # a GGUF Q8_0 LM head (the tied embedding or lm_head) also kept quantized
    q8: dict[str, Q8Matrix] = field(default_factory=dict)


LAYER_TENSORS = ("attn_norm", "wq", "wk", "wv", "wo", "ffn_norm", "w_gate", "w_up", "w_down")
BIAS_TENSORS = ("bq", "bk", "bv")


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
    }
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
            f"but the vocabulary size is {spec.vocab_size}"
        )
    if spec.num_heads % spec.num_kv_heads:
        raise CheckpointError(
            f"{ckpt.source}: {spec.num_heads} attention heads are not a "
            f"multiple of {spec.num_kv_heads} KV heads"
        )
    for name, shape in expected_shapes(spec):
        tensor = ckpt.tensors.get(name)
        if tensor is None:
            raise CheckpointError(f"{ckpt.source}: missing tensor {name}")
        if tensor.shape != shape:
            raise CheckpointError(
                f"{ckpt.source}: tensor {name} has shape {tuple(tensor.shape)}, expected {shape}"
            )
