"""InternLM2 (Hugging Face directories): Llama's layers under other names, with Q, K and V packed
into one wqkv matrix that is split at load."""

from __future__ import annotations

import numpy as np

from agent.model.families.base import Family, HfLayout
from agent.model.spec import ModelSpec

HF_LAYER_NAMES = {
    "attention_norm.weight": "attn_norm",
    "attention.wqkv.weight": "wqkv",
    "attention.wqkv.bias": "bqkv",
    "attention.wo.weight": "wo",
    "ffn_norm.weight": "ffn_norm",
    "feed_forward.w1.weight": "w_gate",
    "feed_forward.w3.weight": "w_up",
    "feed_forward.w2.weight": "w_down",
}
HF_GLOBAL_NAMES = {
    "model.tok_embeddings.weight": "embed",
    "model.norm.weight": "final_norm",
    "output.weight": "lm_head",
}


def unpack_qkv(tensors: dict[str, np.ndarray], spec: ModelSpec) -> None:
    """Each layer's packed wqkv (and bqkv) as wq, wk, wv (bq, bk, bv)."""
    for i in range(spec.num_layers):
        for packed, parts in (
            (f"layers.{i}.wqkv", ("wq", "wk", "wv")),
            (f"layers.{i}.bqkv", ("bq", "bk", "bv")),
        ):
            if packed in tensors:
                split = split_packed_qkv(tensors.pop(packed), spec.num_kv_heads, spec.group_size)
                tensors.update({f"layers.{i}.{part}": t for part, t in zip(parts, split)})


def split_packed_qkv(w: np.ndarray, kv_heads: int, group: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """InternLM2's wqkv rows are (kv head, [group queries, key, value], head_dim) -> wq, wk, wv."""
    rest = w.shape[1:]
    head_dim = w.shape[0] // (kv_heads * (group + 2))
    blocks = w.reshape(kv_heads, group + 2, head_dim, *rest)
    return (
        blocks[:, :group].reshape(kv_heads * group * head_dim, *rest),
        blocks[:, group].reshape(kv_heads * head_dim, *rest),
        blocks[:, group + 1].reshape(kv_heads * head_dim, *rest),
    )


FAMILY = Family("internlm2", hf=HfLayout("internlm2", HF_LAYER_NAMES, HF_GLOBAL_NAMES, transform=unpack_qkv))
