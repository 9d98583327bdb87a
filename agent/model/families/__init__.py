"""The model families this project serves, one module each (base.py says what a module declares),
and their lookup by the name a file gives: GGUF's general.architecture, Hugging Face's model_type.

Adding a family: write its module (its layouts in each format it is read from, its spec fields;
llama.py, qwen2.py and gemma3.py show the three kinds), add its name to MODULES, and test it against
the numpy reference (tests/integration/agent/test_model_families.py)."""

from __future__ import annotations

from importlib import import_module
from pathlib import Path
from typing import TypeVar

from agent.model.checkpoint import CheckpointError
from agent.model.families.base import Family, GgufLayout, HfLayout

MODULES = (
    "llama",
    "qwen2",
    "qwen3",
    "qwen3moe",
    "phi3",
    "gemma3",
    "gemma_embedding",
    "internlm2",
    "mistral",
    "smollm3",
    "qwen35",
    "qwen35moe",
)  # the order the errors list them in

FAMILIES: tuple[Family, ...] = tuple(import_module(f"{__name__}.{name}").FAMILY for name in MODULES)
GGUF: dict[str, GgufLayout] = {f.gguf.architecture: f.gguf for f in FAMILIES if f.gguf is not None}
HF: dict[str, HfLayout] = {f.hf.model_type: f.hf for f in FAMILIES if f.hf is not None}
HF |= {f.hf.multimodal: f.hf.language_model() for f in FAMILIES if f.hf is not None and f.hf.multimodal}
Layout = TypeVar("Layout", GgufLayout, HfLayout)


def gguf_layout(architecture: object, source: Path) -> GgufLayout:
    """The layout of a GGUF file's architecture; a CheckpointError naming the supported ones."""
    return _find(GGUF, architecture, source)


def hf_layout(model_type: object, source: Path) -> HfLayout:
    """The layout of a Hugging Face config's model_type; a CheckpointError naming the supported ones."""
    return _find(HF, model_type, source)


def _find(layouts: dict[str, Layout], name: object, source: Path) -> Layout:
    if not isinstance(name, str) or name not in layouts:
        raise CheckpointError(
            f"{source}: unsupported architecture {name!r} (supported: {', '.join(layouts)})"
        )
    return layouts[name]
