"""Hyperparameters of a decoder-only checkpoint, read from its files (never hard-coded per model): the
LLaMA family's shape, and the choices by which other families differ from it (each a field with the
LLaMA family's value as its default, set from the files by the family's module, agent/model/families/)."""

from __future__ import annotations

import math
from typing import Literal

import numpy as np
from pydantic import BaseModel, ConfigDict


class RopeScaling(BaseModel):
    """A static change of the RoPE frequencies for a longer context than the model was trained on.

    linear: every frequency divided by `factor` (position interpolation);
    llama3: low frequencies divided by `factor`, high ones kept, a smooth blend between (Llama 3.1);
    freq_factors: each frequency divided by its own factor (llama.cpp's `rope_freqs` tensor)."""

    model_config = ConfigDict(frozen=True)

    type: Literal["linear", "llama3", "freq_factors"]
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192
    freq_factors: tuple[float, ...] = ()

    def apply(self, inv_freq: np.ndarray) -> np.ndarray:
        if self.type == "linear":
            return inv_freq / self.factor
        if self.type == "freq_factors":
            return inv_freq / np.asarray(self.freq_factors, np.float64)
        wavelen = 2 * math.pi / inv_freq
        low_wavelen = self.original_max_position / self.low_freq_factor
        high_wavelen = self.original_max_position / self.high_freq_factor
        smooth = (self.original_max_position / wavelen - self.low_freq_factor) / (
            self.high_freq_factor - self.low_freq_factor
        )
        blended = (1 - smooth) * inv_freq / self.factor + smooth * inv_freq
        return np.where(
            wavelen > low_wavelen, inv_freq / self.factor, np.where(wavelen < high_wavelen, inv_freq, blended)
        )


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
    rope_scaling: RopeScaling | None = None
    rms_eps: float
    tied_embeddings: bool
    qkv_bias: bool
    max_context: int
    bos_id: int | None
    eos_ids: tuple[int, ...]
    # Gemma 3's choices (defaults: the LLaMA family's)
    embed_scale: float = 1.0  # the embedding's rows multiplied by this (Gemma: sqrt(hidden_size))
    qk_norm: bool = False  # each query and key head RMS-normed before RoPE (q_norm, k_norm [head_dim])
    post_norms: bool = False  # the attention's and the FFN's outputs RMS-normed before their residual
    activation: Literal["silu", "gelu_tanh"] = "silu"  # the gated FFN's: SwiGLU, or GeGLU (tanh GELU)
    attention_scale: float | None = None  # the queries' scale; None: 1 / sqrt(head_dim)
    sliding_window: int = 0  # positions a local layer attends, its own included (0: no local layers)
    local_layers: tuple[int, ...] = ()  # the layers that attend within the sliding window
    rope_local_theta: float | None = None  # the local layers' RoPE base (unscaled); None: rope_theta
    # SmolLM3's: the layers whose attention rotates nothing (NoPE: no positions in Q and K)
    nope_layers: tuple[int, ...] = ()
    # Qwen3-MoE's sparse FFN: a router picks experts_per_token of num_experts SwiGLU experts a token
    num_experts: int = 0  # 0: every layer's FFN is dense
    experts_per_token: int = 0
    expert_intermediate_size: int = 0
    norm_topk_prob: bool = False  # the chosen experts' weights renormalised to sum to 1
    dense_layers: tuple[int, ...] = ()  # a MoE model's layers with a dense FFN (intermediate_size)

    @property
    def group_size(self) -> int:
        """Query heads per KV head (grouped-query attention)."""
        return self.num_heads // self.num_kv_heads

    @property
    def query_scale(self) -> float:
        return self.attention_scale if self.attention_scale is not None else 1.0 / math.sqrt(self.head_dim)

    def is_local(self, layer: int) -> bool:
        """Whether the layer attends within the sliding window (else to every earlier position)."""
        return self.sliding_window > 0 and layer in self.local_layers

    def rope(self, layer: int) -> Literal["global", "local", "none"]:
        """The layer's rotation of Q and K: the model's RoPE, the local layers' own base, or none."""
        if layer in self.nope_layers:
            return "none"
        return "local" if self.is_local(layer) and self.rope_local_theta is not None else "global"

    def is_moe(self, layer: int) -> bool:
        """Whether the layer's FFN is the routed experts (else dense)."""
        return self.num_experts > 0 and layer not in self.dense_layers

    @property
    def global_layers(self) -> int:
        return self.num_layers - sum(1 for i in range(self.num_layers) if self.is_local(i))

    def rope_inv_freq(self, local: bool = False) -> np.ndarray:
        """[head_dim / 2] rotation frequencies, float64, after any scaling; `local`: the local
        layers' (their own base where the model has one, never scaled)."""
        hd = self.head_dim
        theta = self.rope_local_theta if local and self.rope_local_theta is not None else self.rope_theta
        inv_freq = 1.0 / (theta ** (np.arange(0, hd, 2, dtype=np.float64) / hd))
        if local and self.rope_local_theta is not None:
            return inv_freq
        return inv_freq if self.rope_scaling is None else self.rope_scaling.apply(inv_freq)

    def parameter_count(self) -> int:
        d, f, v = self.hidden_size, self.intermediate_size, self.vocab_size
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        per_layer = d * (q + 2 * kv) + q * d + 3 * d * f + 2 * d
        if self.qkv_bias:
            per_layer += q + 2 * kv
        if self.qk_norm:
            per_layer += 2 * self.head_dim
        if self.post_norms:
            per_layer += 2 * d
        head = 0 if self.tied_embeddings else v * d
        moe_layers = sum(1 for i in range(self.num_layers) if self.is_moe(i))
        # a MoE layer's router and experts in place of the dense FFN
        moe = self.num_experts * (d + 3 * d * self.expert_intermediate_size) - 3 * d * f
        return v * d + head + d + self.num_layers * per_layer + moe_layers * moe
