"""MindSpore checkpoints (.ckpt): canonical tensor names plus the model spec as a JSON entry, so a
checkpoint is self-describing. tools.convert writes them from any other format."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import numpy as np

from agent.model.checkpoint import Checkpoint, CheckpointError, Progress
from agent.model.spec import ModelSpec

FILE_NAME = "model.ckpt"  # in a directory written by tools.convert, beside the tokenizer files
SPEC_KEY = "model_spec"
StorageDtype = Literal["float32", "float16", "bfloat16"]


def save(checkpoint: Checkpoint, path: Path, progress: Progress, dtype: StorageDtype = "float32") -> None:
    import mindspore as ms

    ms_dtype = getattr(ms, dtype)
    names = sorted({*checkpoint.tensors, *checkpoint.blocks})
    items = [
        {"name": name, "data": ms.Tensor(checkpoint.matrix(name), dtype=ms_dtype)} for name in progress(names)
    ]
    ms.save_checkpoint(items, str(path), append_dict={SPEC_KEY: checkpoint.spec.model_dump_json()})


def load(path: Path, progress: Progress) -> Checkpoint:
    import mindspore as ms

    try:
        params = ms.load_checkpoint(str(path))
    except Exception as exc:  # MindSpore raises ValueError/RuntimeError with its own wording
        raise CheckpointError(f"{path}: not a readable MindSpore checkpoint ({exc})") from exc
    spec_json = params.pop(SPEC_KEY, None)
    if not isinstance(spec_json, str):
        raise CheckpointError(
            f"{path}: no {SPEC_KEY!r} entry; this server reads the checkpoints `python -m tools.convert` "
            f"writes (canonical tensor names and the model's hyperparameters); convert the original "
            f"HuggingFace or GGUF files with it"
        )
    try:
        spec = ModelSpec.model_validate_json(spec_json)
    except ValueError as exc:
        raise CheckpointError(f"{path}: the {SPEC_KEY!r} entry is invalid ({exc})") from exc
    # Widened on the host: a MindSpore cast would run a kernel, which starts MindSpore's runtime
    # before the agent has chosen its device (set_device then fails).
    tensors = {
        name: np.ascontiguousarray(param.asnumpy(), dtype=np.float32)
        for name, param in progress(list(params.items()))
    }
    return Checkpoint(spec=spec, tensors=tensors, source=path, format="ckpt")
