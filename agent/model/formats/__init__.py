"""The checkpoint readers, one module per format, and load_checkpoint() that picks one by the path."""

from __future__ import annotations

from pathlib import Path

from agent.model.checkpoint import Checkpoint, CheckpointError, Progress, no_progress, validate
from agent.model.formats import gguf_file, hf_dir, ms_ckpt


def load_checkpoint(path: str | Path, progress: Progress = no_progress) -> Checkpoint:
    """Load a `.gguf` file, a HuggingFace directory (config.json + *.safetensors, sharded or not),
    or a MindSpore `.ckpt` (a file, or a directory holding model.ckpt, as tools.convert writes)."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(
            f"model path does not exist: {path} (`python -m tools.fetch_model --model all` fetches the "
            "shipped models into models/: the default SmolLM2 and Gemma 3 270M)"
        )
    if path.is_file() and path.suffix == ".gguf":
        checkpoint = gguf_file.load(path, progress)
    elif path.is_file() and path.suffix == ".ckpt":
        checkpoint = ms_ckpt.load(path, progress)
    elif path.is_dir() and (path / "config.json").is_file():
        checkpoint = hf_dir.load(path, progress)
    elif path.is_dir() and (path / ms_ckpt.FILE_NAME).is_file():
        checkpoint = ms_ckpt.load(path / ms_ckpt.FILE_NAME, progress)
    else:
        raise CheckpointError(
            f"unrecognised model path {path}: expected a .gguf file, a .ckpt file, "
            f"or a directory with config.json or {ms_ckpt.FILE_NAME}"
        )
    validate(checkpoint)
    return checkpoint
