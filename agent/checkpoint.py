"""Checkpoint loaders: GGUF and HuggingFace safetensors into one in-memory weight format.

Every loader returns a `Checkpoint`: the model's `ModelSpec` and fp32 numpy tensors under canonical
names, matrices in [out, in] layout, Q/K rows in HuggingFace (rotate-half RoPE) order:

    embed [V, D], final_norm [D], lm_head [V, D] (absent when tied),
    layers.{i}.attn_norm [D], wq [H*hd, D], wk [KV*hd, D], wv [KV*hd, D], (bq, bk, bv with QKV bias),
    wo [D, H*hd], ffn_norm [D], w_gate [F, D], w_up [F, D], w_down [D, F]
"""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

from agent.model_spec import ModelSpec

log = logging.getLogger(__name__)


class CheckpointError(Exception):
    """A checkpoint that cannot be loaded; the message says which file and why."""


@dataclass
class Checkpoint:
    spec: ModelSpec
    tensors: dict[str, np.ndarray]
    source: Path
    format: str  # "gguf" or "safetensors"


LAYER_TENSORS = ("attn_norm", "wq", "wk", "wv", "wo", "ffn_norm", "w_gate", "w_up", "w_down")
BIAS_TENSORS = ("bq", "bk", "bv")

# Architectures this code runs, and whether llama.cpp's converter stored their Q/K rows permuted
# into the interleaved (GPT-J) RoPE order; those are un-permuted at load.
GGUF_ARCHITECTURES = {"llama": {"permuted_qk": True, "qkv_bias": False},
                      "qwen2": {"permuted_qk": False, "qkv_bias": True}}
HF_MODEL_TYPES = {"llama": {"qkv_bias": False}, "qwen2": {"qkv_bias": True}}


def load_checkpoint(path: str | Path) -> Checkpoint:
    """Load a `.gguf` file or a HuggingFace directory (config.json + *.safetensors)."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"model path does not exist: {path}")
    if path.is_file() and path.suffix == ".gguf":
        checkpoint = _load_gguf(path)
    elif path.is_dir() and (path / "config.json").is_file():
        checkpoint = _load_hf_dir(path)
    else:
        raise CheckpointError(
            f"unrecognised model path {path}: expected a .gguf file or a directory with config.json")
    _validate(checkpoint)
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


def _validate(ckpt: Checkpoint) -> None:
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


# ----------------------------------------------------------------------------------------- GGUF

GGUF_LAYER_NAMES = {"attn_norm.weight": "attn_norm", "attn_q.weight": "wq", "attn_k.weight": "wk",
                    "attn_v.weight": "wv", "attn_output.weight": "wo", "ffn_norm.weight": "ffn_norm",
                    "ffn_gate.weight": "w_gate", "ffn_up.weight": "w_up", "ffn_down.weight": "w_down",
                    "attn_q.bias": "bq", "attn_k.bias": "bk", "attn_v.bias": "bv"}
GGUF_GLOBAL_NAMES = {"token_embd.weight": "embed", "output_norm.weight": "final_norm",
                     "output.weight": "lm_head"}


def read_gguf(path: Path):
    """Open a GGUF file, turning the reader's low-level errors into a CheckpointError."""
    from gguf import GGUFReader

    try:
        return GGUFReader(str(path))
    except Exception as exc:  # the reader raises ValueError, KeyError, IndexError... on bad files
        raise CheckpointError(f"{path}: not a readable GGUF file ({type(exc).__name__}: {exc})") from exc


def gguf_field(reader, key: str, default=None):
    field = reader.fields.get(key)
    if field is None:
        return default
    return field.contents()


def _load_gguf(path: Path) -> Checkpoint:
    import gguf

    reader = read_gguf(path)
    arch = gguf_field(reader, "general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise CheckpointError(f"{path}: unsupported architecture {arch!r} "
                              f"(supported: {', '.join(GGUF_ARCHITECTURES)})")
    traits = GGUF_ARCHITECTURES[arch]

    def meta(key: str, default=None, required: bool = True):
        value = gguf_field(reader, f"{arch}.{key}", default)
        if value is None and required:
            raise CheckpointError(f"{path}: missing GGUF metadata {arch}.{key}")
        return value

    n_tokens = len(reader.fields["tokenizer.ggml.tokens"].data) \
        if "tokenizer.ggml.tokens" in reader.fields else None
    hidden, heads = meta("embedding_length"), meta("attention.head_count")
    kv_heads = meta("attention.head_count_kv", heads)
    head_dim = meta("attention.key_length", hidden // heads, required=False) or hidden // heads
    tensor_names = {t.name for t in reader.tensors}
    eos = gguf_field(reader, "tokenizer.ggml.eos_token_id")
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
        rms_eps=float(meta("attention.layer_norm_rms_epsilon")),
        tied_embeddings="output.weight" not in tensor_names,
        qkv_bias=traits["qkv_bias"],
        max_context=meta("context_length"),
        bos_id=gguf_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_ids=() if eos is None else (int(eos),),
    )

    tensors: dict[str, np.ndarray] = {}
    for t in reader.tensors:
        name = _gguf_canonical_name(t.name)
        if name is None:
            log.debug("ignoring GGUF tensor %s", t.name)
            continue
        try:
            array = gguf.quants.dequantize(t.data, t.tensor_type)
        except NotImplementedError as exc:
            raise CheckpointError(f"{path}: tensor {t.name} uses quantization type "
                                  f"{t.tensor_type.name}, which cannot be dequantized") from exc
        array = np.ascontiguousarray(array, dtype=np.float32)
        if traits["permuted_qk"] and name.endswith((".wq", ".bq")):
            array = unpermute_qk(array, spec.num_heads)
        elif traits["permuted_qk"] and name.endswith((".wk", ".bk")):
            array = unpermute_qk(array, spec.num_kv_heads)
        tensors[name] = array
    return Checkpoint(spec=spec, tensors=tensors, source=path, format="gguf")


def _gguf_canonical_name(name: str) -> str | None:
    if name in GGUF_GLOBAL_NAMES:
        return GGUF_GLOBAL_NAMES[name]
    if name.startswith("blk."):
        _, index, rest = name.split(".", 2)
        if rest in GGUF_LAYER_NAMES:
            return f"layers.{index}.{GGUF_LAYER_NAMES[rest]}"
    return None


# ------------------------------------------------------------------------- HuggingFace safetensors

HF_LAYER_NAMES = {"input_layernorm.weight": "attn_norm", "self_attn.q_proj.weight": "wq",
                  "self_attn.k_proj.weight": "wk", "self_attn.v_proj.weight": "wv",
                  "self_attn.o_proj.weight": "wo", "post_attention_layernorm.weight": "ffn_norm",
                  "mlp.gate_proj.weight": "w_gate", "mlp.up_proj.weight": "w_up",
                  "mlp.down_proj.weight": "w_down", "self_attn.q_proj.bias": "bq",
                  "self_attn.k_proj.bias": "bk", "self_attn.v_proj.bias": "bv"}
HF_GLOBAL_NAMES = {"model.embed_tokens.weight": "embed", "model.norm.weight": "final_norm",
                   "lm_head.weight": "lm_head"}


def read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"cannot read {path}: {exc}") from exc


def hf_eos_ids(directory: Path, config: dict) -> tuple[int, ...]:
    """EOS ids from generation_config.json (which may list several), else config.json."""
    eos = None
    gen_path = directory / "generation_config.json"
    if gen_path.is_file():
        eos = read_json(gen_path).get("eos_token_id")
    if eos is None:
        eos = config.get("eos_token_id")
    if eos is None:
        return ()
    return tuple(int(e) for e in (eos if isinstance(eos, list) else [eos]))


def _load_hf_dir(directory: Path) -> Checkpoint:
    config = read_json(directory / "config.json")
    model_type = config.get("model_type")
    if model_type not in HF_MODEL_TYPES:
        raise CheckpointError(f"{directory}: unsupported architecture {model_type!r} "
                              f"(supported: {', '.join(HF_MODEL_TYPES)})")
    if config.get("rope_scaling"):
        raise CheckpointError(f"{directory}: rope_scaling {config['rope_scaling']} is not supported")
    try:
        hidden, heads = int(config["hidden_size"]), int(config["num_attention_heads"])
        spec = ModelSpec(
            architecture=model_type,
            name=config.get("_name_or_path") or directory.name,
            num_layers=int(config["num_hidden_layers"]),
            hidden_size=hidden,
            num_heads=heads,
            num_kv_heads=int(config.get("num_key_value_heads") or heads),
            head_dim=int(config.get("head_dim") or hidden // heads),
            intermediate_size=int(config["intermediate_size"]),
            vocab_size=int(config["vocab_size"]),
            rope_theta=float(config.get("rope_theta", 10000.0)),
            rms_eps=float(config.get("rms_norm_eps", 1e-6)),
            tied_embeddings=bool(config.get("tie_word_embeddings", False)),
            qkv_bias=bool(config.get("attention_bias", HF_MODEL_TYPES[model_type]["qkv_bias"])),
            max_context=int(config.get("max_position_embeddings", 2048)),
            bos_id=config.get("bos_token_id"),
            eos_ids=hf_eos_ids(directory, config),
        )
    except KeyError as exc:
        raise CheckpointError(f"{directory / 'config.json'}: missing key {exc.args[0]}") from exc

    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{directory}: no *.safetensors weight files")
    tensors: dict[str, np.ndarray] = {}
    for file in files:
        for hf_name, read in _safetensors_entries(file):
            name = _hf_canonical_name(hf_name)
            if name is None:
                log.debug("ignoring tensor %s in %s", hf_name, file.name)
                continue
            tensors[name] = np.ascontiguousarray(read(), dtype=np.float32)
    return Checkpoint(spec=spec, tensors=tensors, source=directory, format="safetensors")


def _safetensors_entries(file: Path) -> Iterator[tuple[str, Callable[[], np.ndarray]]]:
    """(name, reader) pairs; bf16 is decoded by hand because NumPy has no bfloat16."""
    from safetensors import safe_open

    try:
        handle = safe_open(str(file), framework="np")
    except Exception as exc:
        raise CheckpointError(f"{file}: not a readable safetensors file ({exc})") from exc
    with handle as f:
        for name in f.keys():
            if f.get_slice(name).get_dtype() == "BF16":
                yield name, lambda name=name: _read_bf16(file, name)
            else:
                yield name, lambda name=name: f.get_tensor(name)


def _read_bf16(file: Path, name: str) -> np.ndarray:
    with file.open("rb") as fh:
        header_len = int.from_bytes(fh.read(8), "little")
        entry = json.loads(fh.read(header_len))[name]
    start, end = entry["data_offsets"]
    raw = np.fromfile(file, dtype=np.uint16, count=(end - start) // 2, offset=8 + header_len + start)
    return (raw.astype(np.uint32) << 16).view(np.float32).reshape(entry["shape"])


def _hf_canonical_name(name: str) -> str | None:
    if name in HF_GLOBAL_NAMES:
        return HF_GLOBAL_NAMES[name]
    if name.startswith("model.layers."):
        index, rest = name[len("model.layers."):].split(".", 1)
        if rest in HF_LAYER_NAMES:
            return f"layers.{index}.{HF_LAYER_NAMES[rest]}"
    return None
