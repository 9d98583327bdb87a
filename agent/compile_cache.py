"""Where a process's MindSpore compile cache lives: a folder keyed by everything that changes a
compiled graph or what it captures.

What MindSpore's compile cache stores (checked with MindSpore 2.10 on CPU: a two-op cell compiled
into a cache, then run again from it in new processes with other values; the cached
compile_cache_0.mindir read with `strings`): the optimised graph with every constant folded into it
(Tensor attributes of the cells, Python scalars and flags that picked the graph's structure, custom
ops' library paths), and parameters by name and shape only. A second process with a changed
Parameter value computed with the new value; with a changed Tensor attribute or a Python flag that
selects other ops it silently ran the cached graph. MindSpore's own staleness check hashes only the
Python files its AST walk from the entry script finds (for spawned agents, not ours). So the key
below must hold everything the graphs are built from; parameter data need not be in it, but a
sampled fingerprint of the weights is, as a second line of defence behind the known-answer check
(agent/known_answer.py) that runs every graph against a numpy forward at warm-up.
"""

from __future__ import annotations

import hashlib
import json
import platform
from pathlib import Path

import mindspore as ms
import numpy as np

from agent.kernels import build_id
from agent.model.checkpoint import Checkpoint
from config.schema import RuntimeSection

AGENT_CODE = Path(__file__).resolve().parent
ROOT = AGENT_CODE.parent
FINGERPRINT_SAMPLES = 4096  # elements read from each weight tensor for the fingerprint


def cache_key(checkpoint: Checkpoint, runtime: RuntimeSection) -> dict:
    """Everything a compiled graph depends on, as JSON-able values."""
    # (speculation is the scheduler's: the graphs are the same with it on or off)
    settings = runtime.model_dump(mode="json", exclude={"compile_cache_dir", "cpu_threads", "speculation"})
    settings["num_blocks"] = runtime.planned_num_blocks  # the same pool, however it was given
    return {
        "spec": json.loads(checkpoint.spec.model_dump_json()),
        "runtime": settings,  # shapes, buckets, dtype, kernel choices, slots and lengths
        "format": checkpoint.format,  # layouts the readers produce
        "tensors": sorted((name, str(t.dtype), list(t.shape)) for name, t in checkpoint.tensors.items()),
        # matrices kept in a GGUF's format: their format ids and packed shapes are the graphs' parameters
        "blocks": sorted((name, m.qtype.name, list(m.packed.shape)) for name, m in checkpoint.blocks.items()),
        "weights": weights_fingerprint(checkpoint),
        "agent_code": _files_digest(sorted(AGENT_CODE.rglob("*.py")) + [ROOT / "config" / "schema.py"]),
        "kernels": build_id(),  # sources, headers, flags, compiler, CPU: the library path in the graphs
        "mindspore": ms.__version__,
        "python": platform.python_version(),
    }


def compile_cache_dir(checkpoint: Checkpoint, runtime: RuntimeSection, user: str) -> Path | None:
    """The compile cache of one process (`user`: an agent rank, a tool), or None when disabled. Each
    process gets its own folder below the key's so that concurrent writers never share one; the key's
    inputs are written beside it (key.json) for whoever wonders why a cache was not used."""
    if runtime.compile_cache_dir is None:
        return None
    key = cache_key(checkpoint, runtime)
    text = json.dumps(key, sort_keys=True)
    folder = runtime.compile_cache_dir / hashlib.sha256(text.encode()).hexdigest()[:16]
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "key.json").write_text(json.dumps(key, sort_keys=True, indent=1))
    return folder / user


def use_compile_cache(folder: Path) -> None:
    """This process's graphs compiled into `folder` and read back from it: any time before the
    first graph compiles (the folder's key needs the weights and the planned runtime)."""
    folder.mkdir(parents=True, exist_ok=True)
    ms.set_context(enable_compile_cache=True, compile_cache_path=str(folder))


def weights_fingerprint(checkpoint: Checkpoint) -> str:
    """SHA-256 over each tensor's name, shape and FINGERPRINT_SAMPLES evenly spaced elements (and the
    kept matrices' packed blocks likewise): ~1 ms instead of ~0.4 s for hashing a whole model."""
    digest = hashlib.sha256()
    arrays = list(checkpoint.tensors.items())
    arrays += [(f"{name}.{m.qtype.name}", m.packed) for name, m in checkpoint.blocks.items()]
    for name, array in sorted(arrays, key=lambda item: item[0]):
        flat = array.reshape(-1)
        step = max(1, flat.size // FINGERPRINT_SAMPLES)
        digest.update(f"{name}{array.shape}{array.dtype}".encode())
        digest.update(np.ascontiguousarray(flat[::step]).tobytes())
    return digest.hexdigest()


def _files_digest(paths: list[Path]) -> str:
    digest = hashlib.sha256()
    for path in paths:
        digest.update(str(path.relative_to(ROOT)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()
