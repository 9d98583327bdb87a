"""The checkpoint readers, one module per format, and load_checkpoint() that picks one by the path."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from agent.model.checkpoint import (
    Checkpoint,
    CheckpointError,
    LazyTensors,
    Progress,
    no_progress,
    take_share,
    validate,
)
from agent.model.formats import gguf_file, hf_dir, ms_ckpt
from agent.model.shard import WHOLE_MODEL, TensorSplit


def load_checkpoint(
    path: str | Path,
    progress: Progress = no_progress,
    split: TensorSplit = WHOLE_MODEL,
    dtype: str = "float32",
) -> Checkpoint:
    """Load a `.gguf` file, a HuggingFace directory (config.json + *.safetensors, sharded or not),
    or a MindSpore `.ckpt` (a file, or a directory holding model.ckpt, as tools.convert writes).
    `split`: a tensor-parallel rank's share, read alone with its matrices in `dtype` (take_share);
    the whole model loads as float32 (and a GGUF's kernel formats) whatever `dtype`."""
    path, kind = _locate(Path(path))
    if split.size > 1:
        whole = _open_lazy(path, kind)
        validate(whole)
        return take_share(whole, split, dtype, progress)
    readers = {"gguf": gguf_file.load, "ckpt": ms_ckpt.load, "safetensors": hf_dir.load}
    checkpoint = readers[kind](path, progress)
    validate(checkpoint)
    return checkpoint


def _locate(path: Path) -> tuple[Path, str]:
    """The file or directory to read and its format."""
    if not path.exists():
        raise CheckpointError(
            f"model path does not exist: {path} (`python -m tools.fetch_model --model all` fetches the "
            "shipped models into models/: the default SmolLM2 and Gemma 3 270M)"
        )
    if path.is_file() and path.suffix == ".gguf":
        return path, "gguf"
    if path.is_file() and path.suffix == ".ckpt":
        return path, "ckpt"
    if path.is_dir() and (path / "config.json").is_file():
        return path, "safetensors"
    if path.is_dir() and (path / ms_ckpt.FILE_NAME).is_file():
        return path / ms_ckpt.FILE_NAME, "ckpt"
    raise CheckpointError(
        f"unrecognised model path {path}: expected a .gguf file, a .ckpt file, "
        f"or a directory with config.json or {ms_ckpt.FILE_NAME}"
    )


def _open_lazy(path: Path, kind: str) -> Checkpoint:
    """The checkpoint with its tensors left in the files, read a part at a time."""
    if kind == "gguf":
        return gguf_file.open_lazy(path)
    if kind == "safetensors":
        return hf_dir.open_lazy(path)
    # MindSpore reads a .ckpt whole: a rank's parts are cut from it in memory
    whole = ms_ckpt.load(path, no_progress)
    return dataclasses.replace(whole, tensors=LazyTensors.in_memory(whole.tensors))
