"""HuggingFace model directories: config.json, generation_config.json, *.safetensors (one file or
shards listed in model.safetensors.index.json); one code path, with each family's tensor names and
load-time reshaping from its module (agent/model/families/). An int8 checkpoint's linears (msModelSlim
W8A8, compressed-tensors int8) are read by agent/model/formats/int8_checkpoint.py beside the float tensors."""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
from collections.abc import Callable
from pathlib import Path

import numpy as np

from agent.model.checkpoint import (
    Checkpoint,
    CheckpointError,
    LazyTensors,
    Progress,
    Reader,
    cut,
    no_progress,
)
from agent.model.families import HfLayout, hf_layout
from agent.model.families.base import PROJECTIONS
from agent.model.formats import int8_checkpoint
from agent.model.spec import ModelSpec, RopeScaling

log = logging.getLogger(__name__)

INDEX_FILE = "model.safetensors.index.json"
BF16_BITS = "<u2"  # numpy has no bfloat16: its bits, widened to float32 after the read
MAPPED_DTYPES = {"F32": "<f4", "F16": "<f2", "BF16": BF16_BITS, "F64": "<f8"}
IDENTITY = "torch.nn.modules.linear.Identity"  # a sentence-transformers Dense module's plain kind


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


def rope_parameters(config: dict) -> dict:
    """RoPE's base and scaling: config.json's rope_theta and rope_scaling, or (transformers 5 writes
    them so) its rope_parameters, which holds both (Gemma 3's: per layer type, the global layers'
    here)."""
    parameters = dict(config.get("rope_parameters") or {})
    if isinstance(parameters.get("full_attention"), dict):
        parameters = dict(parameters["full_attention"])
    parameters.update(config.get("rope_scaling") or {})
    if "rope_theta" in config:
        parameters["rope_theta"] = config["rope_theta"]
    return parameters


def rope_scaling(config: dict, source: Path) -> RopeScaling | None:
    scaling = rope_parameters(config)
    if not scaling.keys() - {"rope_theta"}:
        return None
    kind = scaling.get("rope_type", scaling.get("type"))
    try:
        if kind == "default":
            return None
        if kind == "linear":
            return RopeScaling(type="linear", factor=float(scaling["factor"]))
        if kind == "llama3":
            return RopeScaling(
                type="llama3",
                factor=float(scaling["factor"]),
                low_freq_factor=float(scaling["low_freq_factor"]),
                high_freq_factor=float(scaling["high_freq_factor"]),
                original_max_position=int(scaling["original_max_position_embeddings"]),
            )
    except KeyError as exc:
        raise CheckpointError(f"{source}: rope_scaling {kind!r} lacks {exc.args[0]}") from exc
    raise CheckpointError(
        f"{source}: rope_scaling type {kind!r} is not supported (supported: linear, llama3)"
    )


def _spec(directory: Path) -> tuple[ModelSpec, HfLayout]:
    """The model's spec from config.json, and its family's layout."""
    config_path = directory / "config.json"
    config = read_json(config_path)
    layout = hf_layout(config.get("model_type"), directory)
    if layout.language_model_only:  # a multimodal checkpoint: its language model's config
        text = config.get("text_config")
        if not isinstance(text, dict):
            raise CheckpointError(f"{config_path}: a {layout.model_type} config without a text_config")
        config = {**config, **text}
    try:
        hidden, heads = int(config["hidden_size"]), int(config["num_attention_heads"])
        spec = ModelSpec(
            architecture=layout.model_type,
            name=config.get("_name_or_path") or directory.name,
            num_layers=int(config["num_hidden_layers"]),
            hidden_size=hidden,
            num_heads=heads,
            num_kv_heads=int(config.get("num_key_value_heads") or heads),
            head_dim=int(config.get("head_dim") or hidden // heads),
            intermediate_size=int(config["intermediate_size"]),
            vocab_size=int(config["vocab_size"]),
            rope_theta=float(rope_parameters(config).get("rope_theta", 10000.0)),
            rope_scaling=rope_scaling(config, config_path),
            rms_eps=float(config.get("rms_norm_eps", 1e-6)),
            tied_embeddings=bool(config.get("tie_word_embeddings", False)),
            qkv_bias=bool(config.get("attention_bias", config.get("bias", layout.qkv_bias))),
            max_context=int(config.get("max_position_embeddings", 2048)),
            bos_id=config.get("bos_token_id"),
            eos_ids=hf_eos_ids(directory, config),
            **(layout.spec_fields(config) if layout.spec_fields else {}),
        )
    except KeyError as exc:
        raise CheckpointError(f"{config_path}: missing key {exc.args[0]}") from exc
    return spec, layout


def read_spec(directory: Path) -> ModelSpec:
    """The model's spec from its config.json alone (no weights read): planning tools."""
    return _spec(directory)[0]


def load(directory: Path, progress: Progress) -> Checkpoint:
    spec, layout = _spec(directory)
    tensors: dict[str, np.ndarray] = {}
    entries = dict(entry for file in _weight_files(directory) for entry in _safetensors_entries(file))
    int8 = _int8_linears(directory, layout, entries)  # taken out of entries
    for hf_name, read in progress(list(entries.items())):
        name = layout.canonical_name(hf_name)
        if name is None:
            log.debug("ignoring tensor %s", hf_name)
            continue
        tensors[name] = np.ascontiguousarray(read(), dtype=np.float32)
    if layout.transform is not None:
        layout.transform(tensors, spec)
    tensors.update(_projections(directory))
    checkpoint = Checkpoint(spec=spec, tensors=tensors, source=directory, format="safetensors")
    int8_checkpoint.place(int8, checkpoint, tensors, layout.canonical_name)
    return checkpoint


def _projections(directory: Path) -> dict[str, np.ndarray]:
    """sentence-transformers' Dense modules (modules.json), in their order, as the pooled vector's
    projections (PROJECTIONS: EmbeddingGemma's two); {} where the directory has none. Only the
    linear kind is read (no bias, the Identity activation): another is refused, naming it."""
    modules_path = directory / "modules.json"
    modules = read_json(modules_path) if modules_path.is_file() else []
    dense = [m for m in modules if isinstance(m, dict) and str(m.get("type", "")).endswith("Dense")]
    if len(dense) > len(PROJECTIONS):
        raise CheckpointError(
            f"{modules_path}: {len(dense)} Dense modules (at most {len(PROJECTIONS)} are read)"
        )
    projections = {}
    for name, module in zip(PROJECTIONS, dense):
        folder = directory / str(module.get("path", ""))
        config = read_json(folder / "config.json")
        activation = config.get("activation_function", IDENTITY)
        if config.get("bias") or activation != IDENTITY:
            raise CheckpointError(
                f"{folder}: a Dense module with a bias or the activation {activation} is not supported "
                f"(only bias false and {IDENTITY})"
            )
        entries = dict(_safetensors_entries(folder / "model.safetensors"))
        if "linear.weight" not in entries:
            raise CheckpointError(f"{folder / 'model.safetensors'}: no linear.weight")
        projections[name] = np.ascontiguousarray(entries["linear.weight"](), dtype=np.float32)
    return projections


def _int8_linears(
    directory: Path, layout: HfLayout, entries: dict[str, Callable[[], np.ndarray]]
) -> dict[str, int8_checkpoint.Int8Weights]:
    """An int8 checkpoint's linears (none for a float one), their tensors taken out of `entries`."""
    fmt = int8_checkpoint.find_format(directory, read_json(directory / "config.json"))
    if fmt is None:
        return {}
    if layout.transform is not None:
        raise CheckpointError(
            f"{directory}: int8 {layout.model_type} checkpoints are not supported: its packed matrices are "
            "split at load, which int8 blocks are not"
        )
    return int8_checkpoint.read_linears(fmt, entries)


def open_lazy(directory: Path) -> Checkpoint:
    """The checkpoint with its tensors left in the files (LazyTensors): a part of one reads only
    its bytes. A family whose tensors are split at load (InternLM2's packed wqkv) is read whole."""
    spec, layout = _spec(directory)
    if int8_checkpoint.find_format(directory, read_json(directory / "config.json")) is not None:
        # a rank's share of int8 matrices is cut from their float32 values (the Q8_0 products are the
        # whole model's): every rank holds the whole model dequantized while it loads
        whole = load(directory, no_progress)
        log.info(
            "%s: int8 checkpoint: a tensor-parallel rank takes its share of the dequantized weights",
            directory,
        )
        dense = {**whole.tensors, **{name: kept.dequantize() for name, kept in whole.blocks.items()}}
        return dataclasses.replace(whole, tensors=LazyTensors.in_memory(dense), blocks={}, int8={})
    if layout.transform is not None:
        whole = load(directory, no_progress)
        return dataclasses.replace(whole, tensors=LazyTensors.in_memory(whole.tensors))
    shapes: dict[str, tuple[int, ...]] = {}
    readers: dict[str, Reader] = {}
    for file in _weight_files(directory):
        for hf_name, (shape, reader) in _mapped_entries(file).items():
            name = layout.canonical_name(hf_name)
            if name is not None:
                shapes[name], readers[name] = shape, reader
    return Checkpoint(spec=spec, tensors=LazyTensors(shapes, readers), source=directory, format="safetensors")


def _weight_files(directory: Path) -> list[Path]:
    """The shards an index names (each must exist), else every *.safetensors file."""
    index_path = directory / INDEX_FILE
    if index_path.is_file():
        weight_map = read_json(index_path).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(f"{index_path}: no weight_map")
        files = [directory / name for name in sorted(set(weight_map.values()))]
        for file in files:
            if not file.is_file():
                raise CheckpointError(f"{index_path}: shard {file.name} is missing")
        return files
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{directory}: no *.safetensors weight files")
    return files


def _safetensors_entries(file: Path) -> list[tuple[str, Callable[[], np.ndarray]]]:
    """(name, reader) pairs, read when called; the open file stays with the readers. bf16 is
    decoded by hand because NumPy has no bfloat16."""
    from safetensors import safe_open

    try:
        handle = safe_open(str(file), framework="np")
    except Exception as exc:
        raise CheckpointError(f"{file}: not a readable safetensors file ({exc})") from exc
    entries: list[tuple[str, Callable[[], np.ndarray]]] = []
    for name in handle.keys():
        if handle.get_slice(name).get_dtype() == "BF16":
            entries.append((name, functools.partial(_read_bf16, file, name)))
        else:
            entries.append((name, functools.partial(handle.get_tensor, name)))
    return entries


def _read_bf16(file: Path, name: str) -> np.ndarray:
    header_len, header = _header(file)
    entry = header[name]
    start, end = entry["data_offsets"]
    raw = np.fromfile(file, dtype=np.uint16, count=(end - start) // 2, offset=8 + header_len + start)
    return _widen_bf16(raw).reshape(entry["shape"])


def _header(file: Path) -> tuple[int, dict]:
    try:
        with file.open("rb") as fh:
            header_len = int.from_bytes(fh.read(8), "little")
            return header_len, json.loads(fh.read(header_len))
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{file}: not a readable safetensors file ({exc})") from exc


def _widen_bf16(raw: np.ndarray) -> np.ndarray:
    return (raw.astype(np.uint32) << 16).view(np.float32)


def _mapped_entries(file: Path) -> dict[str, tuple[tuple[int, ...], Reader]]:
    """Each tensor's shape and a reader of its rows and columns through a memory map of the file:
    only the part's pages are read, and the map closes with the read."""
    header_len, header = _header(file)
    entries: dict[str, tuple[tuple[int, ...], Reader]] = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        if entry["dtype"] not in MAPPED_DTYPES:
            raise CheckpointError(
                f"{file}: tensor {name} is {entry['dtype']}; a tensor-parallel rank reads "
                f"{', '.join(MAPPED_DTYPES)} tensors"
            )
        shape = tuple(entry["shape"])
        offset = 8 + header_len + entry["data_offsets"][0]
        read = functools.partial(_read_part, file, MAPPED_DTYPES[entry["dtype"]], offset, shape)
        entries[name] = shape, read
    return entries


def _read_part(
    file: Path, dtype: str, offset: int, shape: tuple[int, ...], rows: slice | None, columns: slice | None
) -> np.ndarray:
    mapped = np.memmap(file, dtype=dtype, mode="r", offset=offset, shape=shape)
    part = np.array(cut(mapped, rows, columns))
    return _widen_bf16(part) if dtype == BF16_BITS else part
