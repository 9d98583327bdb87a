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


class LinearAttention(BaseModel):
    """Qwen3.5's Gated DeltaNet layers (agent/kernels/gated_delta.h): which layers they are and their
    shape. Each holds, per sequence, a fixed-size state in place of a KV cache: the conv's last
    conv_kernel - 1 inputs and a [key_dim, value_dim] matrix per value head (float32)."""

    model_config = ConfigDict(frozen=True)

    layers: tuple[int, ...]
    conv_kernel: int
    key_heads: int
    value_heads: int
    key_dim: int
    value_dim: int

    @property
    def channels(self) -> int:
        """The conv's channels: q and k (key_heads x key_dim each), v (value_heads x value_dim)."""
        return 2 * self.key_heads * self.key_dim + self.value_heads * self.value_dim

    @property
    def conv_state(self) -> int:
        """Floats of a sequence's conv state in one layer."""
        return (self.conv_kernel - 1) * self.channels

    @property
    def recurrent_state(self) -> int:
        """Floats of a sequence's recurrent state in one layer."""
        return self.value_heads * self.key_dim * self.value_dim

    @property
    def state_bytes(self) -> int:
        """Bytes of one sequence's state over every such layer."""
        return 4 * (self.conv_state + self.recurrent_state) * len(self.layers)

    def slot_bytes(self, held_rows: int) -> int:
        """Bytes a live slot holds over every such layer: its state, and the conv inputs, b and a
        of the rows a verified step holds for its replay."""
        held = held_rows * (self.channels + 2 * self.value_heads)
        return self.state_bytes + 4 * held * len(self.layers)

    def parameter_count(self, hidden: int) -> int:
        """One layer's weights beside its norms and FFN."""
        width = self.value_heads * self.value_dim
        return (
            hidden * (self.channels + width + 2 * self.value_heads)
            + width * hidden
            + (self.channels * self.conv_kernel + 2 * self.value_heads + self.value_dim)
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
    # Qwen3.5-MoE's: a shared expert every token runs beside its routed ones, weighted by
    # sigmoid(norm(x) . shared_expert_gate) (0: none)
    shared_expert_intermediate_size: int = 0
    # Qwen3.5's: Gated DeltaNet layers in place of attention in some layers (None: every layer attends),
    # the attention layers' output gate (wq's rows hold each head's gate after it) and partial RoPE
    linear_attention: LinearAttention | None = None
    output_gate: bool = False
    rotary_dim: int = 0  # the dims of each head RoPE rotates (0: all of head_dim)
    # an encoder's (EmbeddingGemma's): every position attends the whole prompt, later ones too, and a
    # local layer's window spans sliding_window - 1 positions either side; its prompts run whole
    bidirectional: bool = False

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

    def is_linear(self, layer: int) -> bool:
        """Whether the layer is a Gated DeltaNet layer (a state per sequence, no KV cache)."""
        return self.linear_attention is not None and layer in self.linear_attention.layers

    @property
    def attention_layers(self) -> int:
        """The layers that hold a KV cache."""
        return self.num_layers - (len(self.linear_attention.layers) if self.linear_attention else 0)

    @property
    def rope_dims(self) -> int:
        """The dims of each head RoPE rotates."""
        return self.rotary_dim or self.head_dim

    def is_moe(self, layer: int) -> bool:
        """Whether the layer's FFN is the routed experts (else dense)."""
        return self.num_experts > 0 and layer not in self.dense_layers

    @property
    def global_layers(self) -> int:
        return self.num_layers - sum(1 for i in range(self.num_layers) if self.is_local(i))

    def rope_inv_freq(self, local: bool = False) -> np.ndarray:
        """[rope_dims / 2] rotation frequencies, float64, after any scaling; `local`: the local
        layers' (their own base where the model has one, never scaled)."""
        hd = self.rope_dims
        theta = self.rope_local_theta if local and self.rope_local_theta is not None else self.rope_theta
        inv_freq = 1.0 / (theta ** (np.arange(0, hd, 2, dtype=np.float64) / hd))
        if local and self.rope_local_theta is not None:
            return inv_freq
        return inv_freq if self.rope_scaling is None else self.rope_scaling.apply(inv_freq)

    def parameter_count(self) -> int:
        d, f, v = self.hidden_size, self.intermediate_size, self.vocab_size
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        gate = q if self.output_gate else 0
        attention = d * (q + gate + 2 * kv) + q * d
        if self.qk_norm:
            attention += 2 * self.head_dim
        per_layer = attention + 3 * d * f + 2 * d
        if self.qkv_bias:
            per_layer += q + 2 * kv
        if self.post_norms:
            per_layer += 2 * d
        head = 0 if self.tied_embeddings else v * d
        moe_layers = sum(1 for i in range(self.num_layers) if self.is_moe(i))
        # a MoE layer's router and experts in place of the dense FFN
        moe = self.num_experts * (d + 3 * d * self.expert_intermediate_size) - 3 * d * f
        if self.shared_expert_intermediate_size:
            moe += d + 3 * d * self.shared_expert_intermediate_size
        linear = self.linear_attention
        # a Gated DeltaNet layer's weights in place of the attention's
        delta = 0 if linear is None else len(linear.layers) * (linear.parameter_count(d) - attention)
        return v * d + head + d + self.num_layers * per_layer + moe_layers * moe + delta
