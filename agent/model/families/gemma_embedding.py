"""EmbeddingGemma (GGUF `gemma-embedding`): Gemma 3's layers as an encoder. Every position attends
the whole input (no causal mask), a local layer within a window either side (llama.cpp's symmetric
window of `attention.sliding_window` positions: half of it each way, transformers' |i - j| <
sliding_window // 2 + 1), and the sentence-transformers head after the mean of the final hidden
states: the dense projections (`dense_2`, `dense_3`, written by llama.cpp's converter with
--sentence-transformers-dense-modules), then the server's normalization."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from agent.model.families import gemma3, llama
from agent.model.families.base import PROJECTIONS, Family, GgufLayout, Meta

GGUF_GLOBAL_NAMES = llama.GGUF_GLOBAL_NAMES | {
    "dense_2.weight": PROJECTIONS[0],
    "dense_3.weight": PROJECTIONS[1],
}


def gguf_spec_fields(path: Path, meta: Meta, hidden: int, head_dim: int, layers: int) -> dict[str, Any]:
    fields = gemma3.gguf_spec_fields(path, meta, hidden, head_dim, layers)
    if fields["sliding_window"]:
        fields["sliding_window"] = fields["sliding_window"] // 2 + 1
    return fields | {"bidirectional": True}


FAMILY = Family(
    "gemma_embedding",
    gguf=GgufLayout(
        "gemma-embedding",
        gemma3.GGUF_LAYER_NAMES,
        GGUF_GLOBAL_NAMES,
        spec_fields=gguf_spec_fields,
        encoder=True,
    ),
)
