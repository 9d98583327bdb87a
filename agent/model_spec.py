"""Hyperparameters of a LLaMA-family checkpoint, read from its files (never hard-coded per model)."""
from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class ModelSpec(BaseModel):
    model_config = ConfigDict(frozen=True)

    architecture: str  # e.g. "llama", "qwen2"
    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rope_theta: float
    rms_eps: float
    tied_embeddings: bool
    qkv_bias: bool
    max_context: int
    bos_id: int | None
    eos_ids: tuple[int, ...]

    @property
    def group_size(self) -> int:
        """Query heads per KV head (grouped-query attention)."""
        return self.num_heads // self.num_kv_heads

    @property
    def kv_bytes_per_token(self) -> int:
        """fp32 K and V for one position of one sequence, all layers."""
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * 4

    def parameter_count(self) -> int:
        d, f, v = self.hidden_size, self.intermediate_size, self.vocab_size
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        per_layer = d * (q + 2 * kv) + q * d + 3 * d * f + 2 * d
        if self.qkv_bias:
            per_layer += q + 2 * kv
        head = 0 if self.tied_embeddings else v * d
        return v * d + head + d + self.num_layers * per_layer
