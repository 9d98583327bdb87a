"""GGUF files (llama.cpp's format): metadata -> ModelSpec; matrices of a format the CPU kernels
multiply kept in it (agent/model/quantized.py), the rest (norms, other types) dequantized by the
`gguf` package."""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType

from agent.model.checkpoint import Checkpoint, CheckpointError, Progress
from agent.model.formats.gguf_header import GgufFile
from agent.model.quantized import BlockMatrix, has_kernel
from agent.model.spec import ModelSpec, RopeScaling

log = logging.getLogger(__name__)

# Architectures this code runs, and whether llama.cpp's converter stored their Q/K rows permuted
# into the interleaved (GPT-J) RoPE order; those are un-permuted at load.
ARCHITECTURES = {
    "llama": {"permuted_qk": True, "qkv_bias": False},
    "qwen2": {"permuted_qk": False, "qkv_bias": True},
    "gemma3": {"permuted_qk": False, "qkv_bias": False},
}
# Gemma 3: what llama.cpp's gemma3 architecture takes when the file does not say (its converter
# writes neither): a local layer's RoPE base, and every 6th layer global (layer i local unless
# (i + 1) % 6 == 0), as the model's config says (rope_local_base_freq, sliding_window_pattern).
GEMMA3_LOCAL_ROPE_BASE = 10000.0
GEMMA3_PATTERN = 6
END_OF_TURN = "<end_of_turn>"  # Gemma's end of a chat turn

LAYER_NAMES = {
    "attn_norm.weight": "attn_norm",
    "attn_q.weight": "wq",
    "attn_k.weight": "wk",
    "attn_v.weight": "wv",
    "attn_output.weight": "wo",
    "ffn_norm.weight": "ffn_norm",
    "ffn_gate.weight": "w_gate",
    "ffn_up.weight": "w_up",
    "ffn_down.weight": "w_down",
    "attn_q.bias": "bq",
    "attn_k.bias": "bk",
    "attn_v.bias": "bv",
    "attn_q_norm.weight": "q_norm",
    "attn_k_norm.weight": "k_norm",
    "post_attention_norm.weight": "post_attn_norm",
    "post_ffw_norm.weight": "post_ffn_norm",
}
GLOBAL_NAMES = {"token_embd.weight": "embed", "output_norm.weight": "final_norm", "output.weight": "lm_head"}
ROPE_FREQS = "rope_freqs.weight"  # llama.cpp's per-frequency divisors (Llama 3.1 scaling)
MATRICES = (".wq", ".wk", ".wv", ".wo", ".w_gate", ".w_up", ".w_down", "embed", "lm_head")
MB = 1 << 20


def read_gguf(path: Path) -> GgufFile:
    """Open a GGUF file, turning the reader's low-level errors into a CheckpointError."""
    try:
        return GgufFile(path)
    except Exception as exc:  # struct.error, ValueError, IndexError... on bad files
        raise CheckpointError(f"{path}: not a readable GGUF file ({type(exc).__name__}: {exc})") from exc


def gguf_field(reader: GgufFile, key: str, default=None):
    return reader.values.get(key, default)


def _dequantize(path: Path, tensor) -> np.ndarray:
    import gguf

    try:
        array = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
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


def _spec(path: Path, reader: GgufFile) -> tuple[ModelSpec, dict]:
    """The model's spec from the file's metadata, and its architecture's traits."""
    arch = gguf_field(reader, "general.architecture")
    if arch not in ARCHITECTURES:
        raise CheckpointError(
            f"{path}: unsupported architecture {arch!r} (supported: {', '.join(ARCHITECTURES)})"
        )
    traits = ARCHITECTURES[arch]

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
    spec = ModelSpec(
        architecture=arch,
        name=gguf_field(reader, "general.name", path.stem),
        num_layers=meta("block_count"),
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
        qkv_bias=traits["qkv_bias"],
        max_context=meta("context_length"),
        bos_id=gguf_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_ids=gguf_eos_ids(reader),
        **(_gemma3(path, reader, meta, hidden, head_dim, meta("block_count")) if arch == "gemma3" else {}),
    )
    return spec, traits


def _gemma3(path: Path, reader: GgufFile, meta, hidden: int, head_dim: int, layers: int) -> dict:
    """Gemma 3's fields of the spec: embeddings scaled by sqrt(hidden), QK-norm, four norms a layer,
    GeGLU, the queries scaled by the head size the file gives (key_length: query_pre_attn_scalar of
    every size but 27B, whose file llama.cpp special-cases), local layers of a sliding window with
    their own RoPE base. A file's pattern (attention.sliding_window_pattern: a period, or one flag a
    layer) wins over the default period."""
    window = int(meta("attention.sliding_window", 0, required=False) or 0)
    pattern = meta("attention.sliding_window_pattern", GEMMA3_PATTERN, required=False)
    if isinstance(pattern, list):
        if len(pattern) != layers:
            raise CheckpointError(f"{path}: attention.sliding_window_pattern has {len(pattern)} flags")
        local = tuple(i for i, flag in enumerate(pattern) if flag)
    else:
        local = tuple(i for i in range(layers) if (i + 1) % int(pattern) != 0)
    return {
        "embed_scale": float(np.sqrt(np.float32(hidden))),
        "qk_norm": True,
        "post_norms": True,
        "activation": "gelu_tanh",
        "attention_scale": 1.0 / float(np.sqrt(head_dim)),
        "sliding_window": window,
        "local_layers": local if window else (),
        "rope_local_theta": float(meta("rope.freq_base_swa", GEMMA3_LOCAL_ROPE_BASE, required=False)),
    }


def gguf_eos_ids(reader: GgufFile) -> tuple[int, ...]:
    """The file's EOS, and an end-of-turn token of the vocabulary's (Gemma's <end_of_turn>, which ends
    its chat turns; its generation config lists both)."""
    tokens = gguf_field(reader, "tokenizer.ggml.tokens") or []
    eos = gguf_field(reader, "tokenizer.ggml.eos_token_id")
    ids = [] if eos is None else [int(eos)]
    eot = gguf_field(reader, "tokenizer.ggml.eot_token_id")
    if eot is None and END_OF_TURN in tokens:
        eot = tokens.index(END_OF_TURN)
    if eot is not None and int(eot) not in ids:
        ids.append(int(eot))
    return tuple(ids)


def stored_weights(path: Path) -> tuple[ModelSpec, int]:
    """The model's spec and the bytes its weights will take when loaded (matrices of a kernel
    format at their stored size, the rest as float32), from the file's header alone: a plan can
    refuse a model that does not fit before loading it."""
    reader = read_gguf(path)
    spec, _ = _spec(path, reader)
    total = 0
    for t in reader.tensors:
        name = _canonical_name(t.name)
        if name is None:
            continue
        total += t.n_bytes if _kept_in_format(name, t) else int(np.prod(t.shape)) * 4
    return spec, total


def _kept_in_format(name: str, t) -> bool:
    """Whether the tensor stays in its GGUF format (a layer or head matrix with a kernel for its
    type): the memory plan counts and the loader keeps the same ones."""
    return name.endswith(MATRICES) and len(t.shape) == 2 and has_kernel(t.tensor_type, int(t.shape[0]))


def load(path: Path, progress: Progress) -> Checkpoint:
    reader = read_gguf(path)
    spec, traits = _spec(path, reader)
    tensors: dict[str, np.ndarray] = {}
    kept: list[tuple[str, Callable[[], BlockMatrix]]] = []  # packed on threads below
    for t in reader.tensors:
        name = _canonical_name(t.name)
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
            if traits["permuted_qk"] and heads is not None
            else None
        )
        qtype = GGMLQuantizationType(t.tensor_type)
        matrix = name.endswith(MATRICES) and len(t.shape) == 2
        if _kept_in_format(name, t):
            kept.append((name, functools.partial(_pack, reader, t, qtype, reorder)))
            continue
        array = _dequantize(path, t)
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


def _pack(reader: GgufFile, t, qtype: GGMLQuantizationType, reorder: Callable | None) -> BlockMatrix:
    matrix = BlockMatrix.from_gguf(qtype, t.data, int(t.shape[0]), reorder)
    reader.drop_pages(t)
    return matrix


def _canonical_name(name: str) -> str | None:
    if name in GLOBAL_NAMES:
        return GLOBAL_NAMES[name]
    if name.startswith("blk."):
        _, index, rest = name.split(".", 2)
        if rest in LAYER_NAMES:
            return f"layers.{index}.{LAYER_NAMES[rest]}"
    return None


def unpermute_qk(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's interleaved-RoPE row order: rows (head, pair, 2) -> (head, 2, pair)."""
    out_dim = w.shape[0]
    rest = w.shape[1:]
    head_dim = out_dim // n_heads
    return w.reshape(n_heads, head_dim // 2, 2, *rest).swapaxes(1, 2).reshape(out_dim, *rest)
