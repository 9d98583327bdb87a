"""What a model family declares (one module per family beside this one, registered in __init__.py):
how each file format names its weights, the spec fields its files carry beyond the common ones, and
the load-time reshaping its layout needs (packed matrices, PACKED, are split by rows at load in every
format). No MindSpore: the server reads these to load a tokenizer
and the memory plan to size a model.

The layers themselves are shared (agent/graphs/layers.py and decoder.py): a family's layer
differences are spec fields (agent/model/spec.py: QKV bias, QK-norm, post-norms, GeGLU, sliding
window, embedding scale) that its module sets, each computed once by the shared layer code.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from agent.model.checkpoint import CheckpointError
from agent.model.spec import ModelSpec


class Meta(Protocol):
    """A GGUF metadata reader for the file's architecture: meta("block_count") reads
    "<arch>.block_count"; a missing key is `default`, or a CheckpointError where `required`."""

    def __call__(self, key: str, default: Any = None, required: bool = True) -> Any: ...


# (file, metadata reader, hidden size, head size, layers) -> the family's spec fields (ModelSpec's)
SpecFields = Callable[[Path, Meta, int, int, int], dict[str, Any]]
# Reshapes a family's tensors in place after reading (canonical names, agent/model/checkpoint.py)
Transform = Callable[[dict[str, np.ndarray], ModelSpec], None]
# config.json -> the family's spec fields (ModelSpec's) beyond the common ones
HfSpecFields = Callable[[dict[str, Any]], dict[str, Any]]
# Matrices some families store packed, one above the other (Phi-3's), and the parts they hold
PACKED = {"wqkv": ("wq", "wk", "wv"), "w_gate_up": ("w_gate", "w_up")}
# An embedder's dense projections of its pooled vector (sentence-transformers' Dense modules), in the
# order they apply: canonical names of global tensors, read by the pooling (StepGraphs.projection)
PROJECTIONS = ("projection.0", "projection.1")


def packed_parts(name: str, spec: ModelSpec) -> list[tuple[str, slice | None]]:
    """A canonical tensor name as the tensors it holds, each with its rows of it (None: all):
    "layers.<i>.wqkv" -> wq, wk, wv; "layers.<i>.w_gate_up" -> w_gate, w_up; others as they are."""
    prefix, _, short = name.rpartition(".")
    if short not in PACKED:
        return [(name, None)]
    q, kv, ffn = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim, spec.intermediate_size
    sizes = (q, kv, kv) if short == "wqkv" else (ffn, ffn)
    starts = np.cumsum((0, *sizes))
    return [
        (f"{prefix}.{part}", slice(int(start), int(start + size)))
        for part, start, size in zip(PACKED[short], starts, sizes)
    ]


def split_packed(tensors: dict[str, np.ndarray], spec: ModelSpec) -> None:
    """A Transform: every packed matrix (PACKED) replaced by its parts."""
    for name in [n for n in tensors if n.rpartition(".")[2] in PACKED]:
        packed = tensors.pop(name)
        parts = packed_parts(name, spec)
        rows = sum(r.stop - r.start for _, r in parts if r is not None)
        if packed.shape[0] != rows:
            raise CheckpointError(f"{name} has {packed.shape[0]} rows, its parts {rows}")
        tensors.update({part: packed[r] for part, r in parts})


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
    encoder: bool = False  # its attention is bidirectional (ModelSpec.bidirectional): an embedder's

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
    spec_fields: HfSpecFields | None = None
    # the model_type of the multimodal checkpoints whose language model this family is (Qwen3.5's are
    # published so): read as language_model() says
    multimodal: str | None = None
    language_model_only: bool = False  # this layout reads a multimodal checkpoint's language model

    def canonical_name(self, name: str) -> str | None:
        if self.language_model_only:
            if not name.startswith(LANGUAGE_MODEL):
                # the vision tower's ("model.visual.") and other parts' ("mtp."), but the LM head
                return self.global_names.get(name) if not name.startswith("model.") else None
            name = "model." + name[len(LANGUAGE_MODEL) :]
        elif not name.startswith("model.") and name not in self.global_names:
            name = "model." + name  # a base model's (transformers' AutoModel, an embedder's): no prefix
        return canonical_name(name, "model.layers.", self.layer_names, self.global_names)

    def language_model(self) -> HfLayout:
        """The layout of this family's multimodal checkpoints (`multimodal`): the config's
        text_config holds the model's (hf_dir reads it over the outer config), the tensors lie under
        "model.language_model." (the LM head where this layout's are), and the rest is not read."""
        assert self.multimodal is not None
        return dataclasses.replace(
            self, model_type=self.multimodal, multimodal=None, language_model_only=True
        )


LANGUAGE_MODEL = "model.language_model."


@dataclass(frozen=True)
class Family:
    """A model family: its layouts in the formats it is read from (None: not read from that one)."""

    name: str
    gguf: GgufLayout | None = None
    hf: HfLayout | None = None
