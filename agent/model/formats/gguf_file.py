"""GGUF files (llama.cpp's format): metadata -> ModelSpec, tensor names -> canonical ones by the
architecture's family (agent/model/families/); matrices of a format the CPU kernels multiply kept
in it (agent/model/quantized.py), the rest (norms, other types) dequantized by the `gguf` package."""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from agent.model.checkpoint import (
    Checkpoint,
    CheckpointError,
    LazyTensors,
    Packer,
    Progress,
    Reader,
    cut,
)
from agent.model.families import GgufLayout, gguf_layout
from agent.model.families.base import packed_parts
from agent.model.formats.gguf_header import GgufFile, GgufTensor
from agent.model.quantized import BlockMatrix, block_shape, has_kernel
from agent.model.spec import ModelSpec, RopeScaling

log = logging.getLogger(__name__)

# Tokens that end an answer wherever a vocabulary has them, as llama.cpp's end-of-generation list
# (llama-vocab.cpp) has them: the ends of a chat turn (Llama 3, ChatML, Phi-3, Gemma), Llama 3.1's
# end of a tool-calling message, and the end of text a model emits after its turn (Qwen, DeepSeek).
END_OF_GENERATION = (
    "<|eot_id|>",
    "<|eom_id|>",
    "<|im_end|>",
    "<|end|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "<|end_of_text|>",
    "<｜end▁of▁sentence｜>",
)
ROPE_FREQS = "rope_freqs.weight"  # llama.cpp's per-frequency divisors (Llama 3.1 scaling)
MATRICES = (
    *(".wq", ".wk", ".wv", ".wo", ".w_gate", ".w_up", ".w_down", "embed", "lm_head"),
    *(".delta_qkv", ".delta_z", ".delta_out"),  # a Gated DeltaNet layer's (Qwen3.5's)
)
MB = 1 << 20
R = TypeVar("R")


def read_gguf(path: Path) -> GgufFile:
    """Open a GGUF file, turning the reader's low-level errors into a CheckpointError."""
    try:
        return GgufFile(path)
    except Exception as exc:  # struct.error, ValueError, IndexError... on bad files
        raise CheckpointError(f"{path}: not a readable GGUF file ({type(exc).__name__}: {exc})") from exc


def gguf_field(reader: GgufFile, key: str, default=None):
    return reader.values.get(key, default)


def _dequantize(path: Path, tensor, data: np.ndarray | None = None) -> np.ndarray:
    """The tensor (or `data`, a part of its data) as float32."""
    import gguf

    try:
        array = gguf.quants.dequantize(tensor.data if data is None else data, tensor.tensor_type)
    except NotImplementedError as exc:
        raise CheckpointError(
            f"{path}: tensor {tensor.name} uses quantization type "
            f"{tensor.tensor_type.name}, which cannot be dequantized"
        ) from exc
    return np.array(array, dtype=np.float32, order="C")  # a copy: nothing keeps the file mapped


def _rope_scaling(path: Path, reader, arch: str, tensors_by_name: dict) -> RopeScaling | None:
    kind = gguf_field(reader, f"{arch}.rope.scaling.type", "none")
    if ROPE_FREQS in tensors_by_name:
        factors = _dequantize(path, tensors_by_name[ROPE_FREQS]).reshape(-1)
        return RopeScaling(type="freq_factors", freq_factors=tuple(float(f) for f in factors))
    if kind == "none":
        return None
    if kind == "linear":
        return RopeScaling(type="linear", factor=float(gguf_field(reader, f"{arch}.rope.scaling.factor")))
    raise CheckpointError(
        f"{path}: RoPE scaling type {kind!r} is not supported (supported: linear, "
        f"llama3 through {ROPE_FREQS})"
    )


def _spec(path: Path, reader: GgufFile) -> tuple[ModelSpec, GgufLayout]:
    """The model's spec from the file's metadata, and its family's layout."""
    arch = gguf_field(reader, "general.architecture")
    layout = gguf_layout(arch, path)

    def meta(key: str, default=None, required: bool = True):
        value = gguf_field(reader, f"{arch}.{key}", default)
        if value is None and required:
            raise CheckpointError(f"{path}: missing GGUF metadata {arch}.{key}")
        return value

    tokens = gguf_field(reader, "tokenizer.ggml.tokens")
    n_tokens = None if tokens is None else len(tokens)
    hidden, heads = meta("embedding_length"), meta("attention.head_count")
    kv_heads = meta("attention.head_count_kv", heads)
    head_dim = meta("attention.key_length", hidden // heads, required=False) or hidden // heads
    by_name = {t.name: t for t in reader.tensors}
    # the last nextn_predict_layers blocks are multi-token prediction layers (Qwen3.5's), not the model's
    layers = meta("block_count") - int(meta("nextn_predict_layers", 0, required=False) or 0)
    spec = ModelSpec(
        architecture=layout.architecture,
        name=gguf_field(reader, "general.name", path.stem),
        num_layers=layers,
        hidden_size=hidden,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        intermediate_size=meta("feed_forward_length"),
        vocab_size=meta("vocab_size", n_tokens),
        rope_theta=float(meta("rope.freq_base", 10000.0)),
        rope_scaling=_rope_scaling(path, reader, arch, by_name),
        rms_eps=float(meta("attention.layer_norm_rms_epsilon")),
        tied_embeddings="output.weight" not in by_name,
        qkv_bias=layout.qkv_bias,
        max_context=meta("context_length"),
        bos_id=gguf_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_ids=gguf_eos_ids(reader),
        **(layout.spec_fields(path, meta, hidden, head_dim, layers) if layout.spec_fields else {}),
    )
    return spec, layout


def gguf_eos_ids(reader: GgufFile) -> tuple[int, ...]:
    """The file's EOS, end-of-turn and end-of-message tokens, then the vocabulary's end-of-generation
    tokens (END_OF_GENERATION: an instruct model's file often names only one of the tokens its
    generation config lists, Llama 3's <|eot_id|> or <|end_of_text|>, Qwen's <|im_end|> or
    <|endoftext|>)."""
    tokens = gguf_field(reader, "tokenizer.ggml.tokens") or []
    keys = ("eos_token_id", "eot_token_id", "eom_token_id")
    ids = [int(i) for i in (gguf_field(reader, f"tokenizer.ggml.{key}") for key in keys) if i is not None]
    named = set(END_OF_GENERATION)
    ids += [i for i, token in enumerate(tokens) if token in named]
    return tuple(dict.fromkeys(ids))


def stored_weights(path: Path) -> tuple[ModelSpec, int]:
    """The model's spec and the bytes its weights will take when loaded (matrices of a kernel
    format at their stored size, the rest as float32), from the file's header alone: a plan can
    refuse a model that does not fit before loading it."""
    reader = read_gguf(path)
    spec, layout = _spec(path, reader)
    total = 0
    for t, name, rows in _parts(reader, layout, spec):
        if name is None:
            continue
        size = t.n_bytes if _kept_in_format(name, t) else int(np.prod(t.shape)) * 4
        total += size if rows is None else size * (rows.stop - rows.start) // int(t.shape[-1])
    return spec, total


def _parts(
    reader: GgufFile, layout: GgufLayout, spec: ModelSpec
) -> Iterator[tuple[Any, str | None, slice | None]]:
    """Each tensor with its canonical name (None: not read) and rows, a packed matrix (Phi-3's
    attn_qkv, ffn_up: families.base.PACKED) once for each of its parts."""
    for t in reader.tensors:
        name = layout.canonical_name(t.name)
        if name is not None and name.startswith("layers.") and int(name.split(".")[1]) >= spec.num_layers:
            name = None  # an MTP layer's
        if name is not None and len(t.shape) == 3:  # a MoE layer's experts: each its own matrix
            yield from _experts(t, name)
            continue
        for part, rows in [(None, None)] if name is None else packed_parts(name, spec):
            yield t, part, rows


def _experts(t: GgufTensor, name: str) -> Iterator[tuple[GgufTensor, str, None]]:
    """A 3-D tensor of llama.cpp's experts [experts, out, in] ("layers.<i>.experts.w_gate") as each
    expert's matrix, a view of its data ("layers.<i>.experts.<e>.w_gate")."""
    prefix, _, short = name.rpartition(".")
    experts = int(t.shape[2])
    size = t.n_bytes // experts
    rows = int(t.shape[1])
    for e in range(experts):
        data = t.data[e] if t.data.ndim == 3 else t.data[e * rows : (e + 1) * rows]
        view = dataclasses.replace(
            t, name=f"{t.name}[{e}]", shape=t.shape[:2], data=data, n_bytes=size, start=t.start + e * size
        )
        yield view, f"{prefix}.{e}.{short}", None


def _kept_in_format(name: str, t) -> bool:
    """Whether the tensor stays in its GGUF format (a layer or head matrix with a kernel for its
    type): the memory plan counts and the loader keeps the same ones."""
    return name.endswith(MATRICES) and len(t.shape) == 2 and has_kernel(t.tensor_type, int(t.shape[0]))


def load(path: Path, progress: Progress) -> Checkpoint:
    reader = read_gguf(path)
    spec, layout = _spec(path, reader)
    tensors: dict[str, np.ndarray] = {}
    kept: list[tuple[str, Callable[[], BlockMatrix]]] = []  # packed on threads below
    for t, name, rows in _parts(reader, layout, spec):
        if name is None:
            if t.name != ROPE_FREQS:
                log.debug("ignoring GGUF tensor %s", t.name)
            continue
        heads = (
            spec.num_heads
            if name.endswith((".wq", ".bq"))
            else spec.num_kv_heads
            if name.endswith((".wk", ".bk"))
            else None
        )
        reorder = (
            functools.partial(unpermute_qk, n_heads=heads)
            if layout.permuted_qk and heads is not None
            else None
        )
        qtype = GGMLQuantizationType(t.tensor_type)
        matrix = name.endswith(MATRICES) and len(t.shape) == 2
        if _kept_in_format(name, t):
            kept.append((name, functools.partial(_pack, reader, t, qtype, reorder, rows)))
            continue
        array = cut(_dequantize(path, t), rows, None)
        if matrix and qtype != GGMLQuantizationType.F32:
            log.warning(
                "%s: tensor %s of type %s has no CPU kernel: dequantized to float32 "
                "(%.1f MB instead of %.1f MB)",
                path.name,
                t.name,
                qtype.name,
                array.nbytes / MB,
                t.n_bytes / MB,
            )
        tensors[name] = array if reorder is None else reorder(array)
    # numpy's copies release the GIL: the matrices pack on every core (1B Q4_K_M: 1.2 -> 0.8 s)
    with ThreadPoolExecutor(os.cpu_count() or 1) as pool:
        packed = pool.map(lambda job: job[1](), kept)
        blocks = {name: matrix for (name, _), matrix in zip(kept, progress(packed))}
    return Checkpoint(spec=spec, tensors=tensors, source=path, format="gguf", blocks=blocks)


def open_lazy(path: Path) -> Checkpoint:
    """The checkpoint with its tensors left in the memory-mapped file (LazyTensors): a part of one
    reads and dequantizes only the blocks that hold it."""
    reader = read_gguf(path)
    spec, layout = _spec(path, reader)
    shapes: dict[str, tuple[int, ...]] = {}
    readers: dict[str, Reader] = {}
    packers: dict[str, Packer] = {}
    for t, name, rows in _parts(reader, layout, spec):
        if name is None:
            continue
        permuted = layout.permuted_qk and name.endswith((".wq", ".bq", ".wk", ".bk"))
        shape = tuple(reversed(t.shape))
        shapes[name] = shape if rows is None else (rows.stop - rows.start, *shape[1:])
        readers[name] = _within(
            rows, functools.partial(_read_part, path, reader, t, spec.head_dim if permuted else 0)
        )
        if _kept_in_format(name, t):
            packers[name] = _within(
                rows, functools.partial(_pack_part, reader, t, spec.head_dim if permuted else 0)
            )
    return Checkpoint(spec=spec, tensors=LazyTensors(shapes, readers, packers), source=path, format="gguf")


def _pack_part(
    reader: GgufFile, t, permuted_head_dim: int, rows: slice | None, columns: slice | None
) -> BlockMatrix | None:
    """Rows and columns of a matrix kept in its format, None where the columns cut through a block
    (its rows are runs of whole blocks, agent/model/quantized.py: no block holds two rows' weights)."""
    qtype = GGMLQuantizationType(t.tensor_type)
    raw, cols = cut(t.data, rows, None), int(t.shape[0])
    if columns is not None:
        block = block_shape(qtype)[0]
        if columns.start % block or columns.stop % block:
            return None
        cols = columns.stop - columns.start
        if raw.dtype == np.uint8:  # bytes of blocks; float types hold their values
            weights, size = GGML_QUANT_SIZES[qtype]
            columns = slice(columns.start // weights * size, columns.stop // weights * size)
        raw = raw[:, columns]
    heads = len(raw) // permuted_head_dim if permuted_head_dim else 0
    reorder = functools.partial(unpermute_qk, n_heads=heads) if heads else None
    matrix = BlockMatrix.from_gguf(qtype, raw, cols, reorder)
    reader.drop_pages(t)
    return matrix


def _read_part(
    path: Path, reader: GgufFile, t, permuted_head_dim: int, rows: slice | None, columns: slice | None
) -> np.ndarray:
    """Rows and columns of a tensor as float32. Rows are whole in every format; a block format's
    columns are runs of blocks, so the blocks that hold the columns are dequantized and the columns
    cut from them (a share's edge inside a block costs one block a row). Q/K rows: a run of whole
    heads, whose interleaved RoPE order is undone head by head (`permuted_head_dim`)."""
    data = cut(t.data, rows, None)
    if columns is None or data.dtype != np.uint8:  # float types: data holds the values
        array = cut(_dequantize(path, t, data), None, columns)
    else:
        block, size = GGML_QUANT_SIZES[GGMLQuantizationType(t.tensor_type)]
        first, last = columns.start // block, -(-columns.stop // block)
        blocks = np.ascontiguousarray(data[:, first * size : last * size])
        array = _dequantize(path, t, blocks)[:, columns.start - first * block : columns.stop - first * block]
    reader.drop_pages(t)
    if permuted_head_dim:
        array = unpermute_qk(array, len(array) // permuted_head_dim)
    return np.ascontiguousarray(array)


def _within(
    part: slice | None, read: Callable[[slice | None, slice | None], R]
) -> Callable[[slice | None, slice | None], R]:
    """A reader (or packer) of a packed matrix's part: rows counted within the part's rows."""
    if part is None:
        return read

    def read_part(rows: slice | None, columns: slice | None) -> R:
        start, stop, _ = (rows or slice(None)).indices(part.stop - part.start)
        return read(slice(part.start + start, part.start + stop), columns)

    return read_part


def _pack(
    reader: GgufFile, t, qtype: GGMLQuantizationType, reorder: Callable | None, rows: slice | None
) -> BlockMatrix:
    matrix = BlockMatrix.from_gguf(qtype, cut(t.data, rows, None), int(t.shape[0]), reorder)
    reader.drop_pages(t)
    return matrix


def unpermute_qk(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's interleaved-RoPE row order: rows (head, pair, 2) -> (head, 2, pair)."""
    out_dim = w.shape[0]
    rest = w.shape[1:]
    head_dim = out_dim // n_heads
    return w.reshape(n_heads, head_dim // 2, 2, *rest).swapaxes(1, 2).reshape(out_dim, *rest)
