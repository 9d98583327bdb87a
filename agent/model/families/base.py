"""What a model family declares (one module per family beside this one, registered in __init__.py):
how each file format names its weights, the spec fields its files carry beyond the common ones, and
the load-time reshaping its layout needs. No MindSpore: the server reads these to load a tokenizer
and the memory plan to size a model.

The layers themselves are shared (agent/graphs/layers.py and decoder.py): a family's layer
differences are spec fields (agent/model/spec.py: QKV bias, QK-norm, post-norms, GeGLU, sliding
window, embedding scale) that its module sets, each computed once by the shared layer code.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from agent.model.spec import ModelSpec


class Meta(Protocol):
    """A GGUF metadata reader for the file's architecture: meta("block_count") reads
    "<arch>.block_count"; a missing key is `default`, or a CheckpointError where `required`."""

    def __call__(self, key: str, default: Any = None, required: bool = True) -> Any: ...


# (file, metadata reader, hidden size, head size, layers) -> the family's spec fields (ModelSpec's)
SpecFields = Callable[[Path, Meta, int, int, int], dict[str, Any]]
# Reshapes a family's tensors in place after reading (canonical names, agent/model/checkpoint.py)
Transform = Callable[[dict[str, np.ndarray], ModelSpec], None]


def canonical_name(
    name: str, layer_prefix: str, layer_names: Mapping[str, str], global_names: Mapping[str, str]
) -> str | None:
    """A file's tensor name as the checkpoint's canonical one ("<prefix><i>.<rest>" ->
    "layers.<i>.<mapped rest>"), None for a tensor the family does not read."""
    if name in global_names:
        return global_names[name]
    if name.startswith(layer_prefix):
        index, _, rest = name[len(layer_prefix) :].partition(".")
        if rest in layer_names:
            return f"layers.{index}.{layer_names[rest]}"
    return None


@dataclass(frozen=True)
class GgufLayout:
    """A family in llama.cpp's GGUF files, whose general.architecture is `architecture`."""

    architecture: str
    layer_names: Mapping[str, str]  # after "blk.<i>.": "attn_q.weight" -> "wq"
    global_names: Mapping[str, str]
    qkv_bias: bool = False
    permuted_qk: bool = False  # llama.cpp's converter stored Q/K rows in the interleaved RoPE order
    spec_fields: SpecFields | None = None
    chat_template: str | None = None  # the one agent/model/templates/ ships for files without one

    def canonical_name(self, name: str) -> str | None:
        return canonical_name(name, "blk.", self.layer_names, self.global_names)


@dataclass(frozen=True)
class HfLayout:
    """A family in Hugging Face directories, whose config.json model_type is `model_type`."""

    model_type: str
    layer_names: Mapping[str, str]  # after "model.layers.<i>.": "self_attn.q_proj.weight" -> "wq"
    global_names: Mapping[str, str]
    qkv_bias: bool = False  # the default when config.json does not say
    transform: Transform | None = None

    def canonical_name(self, name: str) -> str | None:
        return canonical_name(name, "model.layers.", self.layer_names, self.global_names)


@dataclass(frozen=True)
class Family:
    """A model family: its layouts in the formats it is read from (None: not read from that one)."""

    name: str
    gguf: GgufLayout | None = None
    hf: HfLayout | None = None
