"""Checkpoints: one in-memory weight format that every file format loads into.

A `Checkpoint` is the model's `ModelSpec` and its tensors under canonical names, matrices in
[out, in] layout, Q/K rows in HuggingFace (rotate-half RoPE) order: fp32 numpy arrays, or a GGUF's
matrices kept in their file's format (`blocks`, agent/model/quantized.py; `matrix()` dequantizes one):

    embed [V, D], final_norm [D], lm_head [V, D] (absent when tied),
    layers.{i}.attn_norm [D], wq [H*hd, D], wk [KV*hd, D], wv [KV*hd, D], (bq, bk, bv with QKV bias),
    wo [D, H*hd], ffn_norm [D], w_gate [F, D], w_up [F, D], w_down [D, F],
    (q_norm, k_norm [hd] with QK-norm; post_attn_norm, post_ffn_norm [D] with post-norms: Gemma 3's)
    a MoE layer (Qwen3-MoE) instead of w_gate, w_up, w_down: router [E, D], and each expert e's
    experts.{e}.w_gate [Fe, D], experts.{e}.w_up [Fe, D], experts.{e}.w_down [D, Fe]; with a shared
    expert (Qwen3.5-MoE) also shared_expert_gate [1, D] and shared_expert.w_gate [Fs, D],
    shared_expert.w_up [Fs, D], shared_expert.w_down [D, Fs]

Norm weights multiply as they are: a Gemma checkpoint's (1 + w) is formed at load (llama.cpp's
converter has already added the 1 in a GGUF file).

A tensor-parallel rank loads only its share (agent/model/shard.py): its rows and columns of the layer
matrices, read from the files one tensor at a time and converted once into the compute dtype, so
its host memory is about its share's size, not the model's (take_share).

The readers live in agent/model/formats/ (GGUF files, HuggingFace directories, MindSpore .ckpt
files), with load_checkpoint() choosing one by the path.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import numpy as np

from agent.model.quantized import Q8_0, BlockMatrix, Int8Linear
from agent.model.shard import WHOLE_MODEL, LayerShare, TensorSplit
from agent.model.spec import ModelSpec

T = TypeVar("T")
Progress = Callable[[Iterable[T]], Iterable[T]]  # wraps the tensor loop (e.g. tqdm); identity by default
Reader = Callable[[slice | None, slice | None], np.ndarray]  # (rows, columns; None: all) -> a float array
Packer = Callable[[slice | None, slice | None], "BlockMatrix | None"]
# numpy has no bfloat16: a bfloat16 rank holds float32 on the host, its Parameters bfloat16
HOST_DTYPES = {"float32": np.float32, "float16": np.float16, "bfloat16": np.float32}


class CheckpointError(Exception):
    """A checkpoint that cannot be loaded; the message says which file and why."""


def cut(array: np.ndarray, rows: slice | None, columns: slice | None) -> np.ndarray:
    if rows is not None:
        array = array[rows]
    return array if columns is None else array[:, columns]


class LazyTensors(Mapping[str, np.ndarray]):
    """A checkpoint's tensors left in its files, each read when asked and not kept: whole as float32
    (`lazy[name]`), or only some rows and columns (`part`)."""

    def __init__(
        self,
        shapes: dict[str, tuple[int, ...]],
        readers: dict[str, Reader],
        packers: dict[str, Packer] | None = None,
    ):
        """packers: for the matrices a whole load keeps in their file's format (Checkpoint.blocks),
        a part in that format, or None where its columns cut through the format's blocks."""
        self.shapes, self.readers, self.packers = shapes, readers, packers or {}

    @classmethod
    def in_memory(cls, tensors: Mapping[str, np.ndarray]) -> LazyTensors:
        """Tensors a format could only read whole, their parts cut in memory."""

        def reader(array: np.ndarray) -> Reader:
            return lambda rows, columns: cut(array, rows, columns)

        return cls({n: a.shape for n, a in tensors.items()}, {n: reader(a) for n, a in tensors.items()})

    def __getitem__(self, name: str) -> np.ndarray:
        return np.asarray(self.readers[name](None, None), np.float32)

    def __iter__(self) -> Iterator[str]:
        return iter(self.readers)

    def __len__(self) -> int:
        return len(self.readers)

    def part(self, name: str, rows: slice | None, columns: slice | None) -> np.ndarray:
        return self.readers[name](rows, columns)


@dataclass
class Checkpoint:
    spec: ModelSpec
    tensors: Mapping[str, np.ndarray]  # float32 (a rank's share: its matrices in the compute dtype)
    source: Path
    format: str  # "gguf", "safetensors" or "ckpt"
    # GGUF matrices in a format the CPU kernels multiply, kept packed in that format (not in tensors)
    blocks: dict[str, BlockMatrix] = field(default_factory=dict)
    # A tensor-parallel rank's share: the layer matrices hold only `split`'s rows and columns
    # (LayerShare.cut), and whole_tensors reads the whole model's from the files when asked.
    split: TensorSplit = WHOLE_MODEL
    whole_tensors: LazyTensors | None = None
    # An int8 checkpoint's (agent/model/formats/int8_checkpoint.py) linears by canonical name: their
    # scales for Ascend's quantized products; the matrices themselves are in blocks or tensors
    int8: dict[str, Int8Linear] = field(default_factory=dict)

    def whole(self) -> Checkpoint:
        """The whole model: this checkpoint, or a share's files read a tensor at a time (the known
        answer's numpy forward then holds one tensor of the model beside the share, not all)."""
        if self.whole_tensors is None:
            return self
        return Checkpoint(self.spec, self.whole_tensors, self.source, self.format)

    def matrix(self, name: str) -> np.ndarray:
        """A tensor as float32, a kept matrix dequantized (a new array each call)."""
        kept = self.blocks.get(name)
        return self.tensors[name] if kept is None else kept.dequantize()

    def int8_weight(self, name: str) -> np.ndarray:
        """An int8 checkpoint's matrix as the file's int8 values [out, in]: a Q8_0 matrix's quants, or a
        float32 one divided by its rows' scales (|q| <= 128, so the quotient rounds back exactly)."""
        kept = self.blocks.get(name)
        if kept is not None and kept.qtype == Q8_0:
            return kept.int8_quants()
        scale = self.int8[name].weight_scale[:, None]
        return np.rint(self.matrix(name) / scale).astype(np.int8)

    def kept(self, name: str) -> BlockMatrix | None:
        """A matrix kept in its GGUF format, or None; a lazy view's packed from the file when asked."""
        if isinstance(self.tensors, LazyTensors) and name in self.tensors.packers:
            return self.tensors.packers[name](None, None)
        return self.blocks.get(name)

    def shape(self, name: str) -> tuple[int, ...] | None:
        kept = self.blocks.get(name)
        if kept is not None:
            return kept.shape
        if isinstance(self.tensors, LazyTensors):  # from the files' headers, nothing read
            return self.tensors.shapes.get(name)
        tensor = self.tensors.get(name)
        return None if tensor is None else tuple(tensor.shape)

    def weight_bytes(self) -> int:
        """The memory the weights take as loaded."""
        return sum(t.nbytes for t in self.tensors.values()) + sum(b.nbytes for b in self.blocks.values())


LAYER_TENSORS = ("attn_norm", "wq", "wk", "wv", "wo", "ffn_norm", "w_gate", "w_up", "w_down")
BIAS_TENSORS = ("bq", "bk", "bv")
QK_NORM_TENSORS = ("q_norm", "k_norm")
POST_NORM_TENSORS = ("post_attn_norm", "post_ffn_norm")
DENSE_FFN_TENSORS = ("w_gate", "w_up", "w_down")  # a MoE layer's experts hold its FFN instead
DELTA_TENSORS = (  # a Gated DeltaNet layer's (Qwen3.5's), in place of the attention's
    *("delta_qkv", "delta_z", "delta_beta", "delta_alpha", "delta_out"),
    *("delta_conv", "delta_dt_bias", "delta_a", "delta_norm"),
)


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
    if spec.output_gate:  # each head's query, then its gate
        shapes["wq"] = (2 * q, d)
    names = LAYER_TENSORS + (BIAS_TENSORS if spec.qkv_bias else ())
    names += (QK_NORM_TENSORS if spec.qk_norm else ()) + (POST_NORM_TENSORS if spec.post_norms else ())
    linear = spec.linear_attention
    if linear is not None:  # a Gated DeltaNet layer's in place of the attention's
        width, c = linear.value_heads * linear.value_dim, linear.channels
        shapes |= {
            "delta_qkv": (c, d),
            "delta_z": (width, d),
            "delta_beta": (linear.value_heads, d),
            "delta_alpha": (linear.value_heads, d),
            "delta_out": (d, width),
            "delta_conv": (c, linear.conv_kernel),
            "delta_dt_bias": (linear.value_heads,),
            "delta_a": (linear.value_heads,),
            "delta_norm": (linear.value_dim,),
        }
    for i in range(spec.num_layers):
        moe = spec.is_moe(i)
        layer_names = names
        if spec.is_linear(i):
            layer_names = ("attn_norm", "ffn_norm", *DENSE_FFN_TENSORS, *DELTA_TENSORS)
        for name in layer_names:
            if not (moe and name in DENSE_FFN_TENSORS):
                yield f"layers.{i}.{name}", shapes[name]
        if moe:
            yield from expert_shapes(spec, i)


def expert_shapes(spec: ModelSpec, layer: int) -> Iterator[tuple[str, tuple[int, ...]]]:
    """A MoE layer's router [E, D] and each expert's SwiGLU matrices (in place of the dense FFN's),
    and its shared expert's where the model has one."""
    d, f = spec.hidden_size, spec.expert_intermediate_size
    yield f"layers.{layer}.router", (spec.num_experts, d)
    for e in range(spec.num_experts):
        for name, shape in (("w_gate", (f, d)), ("w_up", (f, d)), ("w_down", (d, f))):
            yield f"layers.{layer}.experts.{e}.{name}", shape
    fs = spec.shared_expert_intermediate_size
    if fs:
        yield f"layers.{layer}.shared_expert_gate", (1, d)
        for name, shape in (("w_gate", (fs, d)), ("w_up", (fs, d)), ("w_down", (d, fs))):
            yield f"layers.{layer}.shared_expert.{name}", shape


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


def take_share(whole: Checkpoint, split: TensorSplit, dtype: str, progress: Progress) -> Checkpoint:
    """A tensor-parallel rank's share of a checkpoint whose tensors are left in its files: each
    tensor's rows and columns of `split` read alone; a matrix a whole load keeps in its GGUF format
    stays in it (its rows, and its columns where the share's edges fall between blocks), the other
    matrices converted once into the compute `dtype` (float32 on the host for bfloat16), norms and
    biases float32."""
    if not isinstance(whole.tensors, LazyTensors):
        raise TypeError("take_share reads a checkpoint opened lazily (formats.load_checkpoint)")
    lazy, share = whole.tensors, LayerShare.of(whole.spec, split)
    tensors, blocks = {}, {}
    for name in progress(list(lazy)):
        rows, columns = share.cut(name)
        pack = lazy.packers.get(name)
        kept = None if pack is None else pack(rows, columns)
        if kept is not None:
            blocks[name] = kept
            continue
        part = lazy.part(name, rows, columns)
        held = HOST_DTYPES[dtype] if part.ndim == 2 else np.float32
        tensors[name] = np.ascontiguousarray(part, dtype=held)
    return Checkpoint(whole.spec, tensors, whole.source, whole.format, blocks, split, whole_tensors=lazy)
