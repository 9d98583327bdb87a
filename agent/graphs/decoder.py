"""The decoder-only transformer in MindSpore that every family runs (agent/model/families/: what
each family's files hold; agent/graphs/layers.py: the shared math): its layers, their weights (kept
in their file's block formats for the CPU kernels) and the KV cache, as Parameters that every graph
of agent/graphs/step_graphs.py shares. A layer runs op by op or as one fused kernel; the layer
features of the spec beyond Llama's (post-norms, GeGLU, sliding window: Gemma 3's) are options of
the fused kernel only; Qwen3's QK-norm runs either way, Qwen3-MoE's experts in their own op after
either (agent/graphs/moe.py).

Layout choices come from measurements (../shared/MINDSPORE_CPU.md and our own on an AVX-512 Xeon):
- Q/K/V are one fused matmul and gate/up another; layer weights are stored [in, out] (on the Xeon,
  1.5-2.5x faster than [out, in] with transpose_b at B >= 4, slightly slower at B = 1), the lm_head
  stays [vocab, hidden] with transpose_b (2x faster there, and it is the embedding when tied);
- the KV cache is one flat Parameter per layer and kind, paged in blocks of B positions:
  [blocks * kv_heads * B, head_dim], position p of head h of a sequence with block table T at row
  (T[p // B] * kv_heads + h) * B + p % B (agent/graphs/interface.py); graphs write it with
  scatter_update (or the fused kernel) and read only the rows they attend to (gather, or the kernels
  through the block tables), so the cache never leaves the device and is never reshaped (a reshape
  of the updated cache copied all of it every layer);
- scratch blocks past the pool the server hands out take the writes of padded batch rows.

Every reshape has at most one unknown dimension, so the graphs compile with static shapes or with
dynamic-shape inputs alike. The host computes all indices and masks (agent/graphs/interface.py).
"""

from __future__ import annotations

from typing import Any

import mindspore as ms
import numpy as np
from mindspore import Parameter, Tensor, nn, ops

from agent.graphs.cache_format import CacheFormat
from agent.graphs.layers import (
    MATMUL_TILE,
    WHOLE_MODEL,
    CpuKernels,
    LayerShare,
    TensorSplit,
    fused_only_features,
    kept_param,
    pack_for_kernel,
    param,
    rms_norm,
    zeros,
)
from agent.graphs.moe import ExpertsFfn, mindspore_experts, zero_ffn
from agent.graphs.paged_attention import PagedBackend
from agent.graphs.quant_matmul import Int8Matmul, int8_matmul_cell
from agent.graphs.shapes import NO_STATES, StateSlots
from agent.model.checkpoint import Checkpoint
from agent.model.quantized import BlockMatrix
from agent.model.spec import ModelSpec

MATRICES = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")
# A layer's inputs to the fused kernel after the step's (fused_layer.cc FusedStack), in its order
FUSED_LAYER_INPUTS = (
    "attn_norm",
    "bqkv",
    "k_cache",
    "v_cache",
    "ffn_norm",
    "formats",
    *MATRICES,
    "q_norm",
    "k_norm",
    "post_attn_norm",
    "post_ffn_norm",
    "options",
)
# A Gated DeltaNet layer's, in the same places (fused_layer.cc: the kind 1 layer's inputs)
DELTA_LAYER_INPUTS = (
    "attn_norm",
    "held",
    "conv_state",
    "recurrent_state",
    "ffn_norm",
    "formats",
    "delta_qkv",
    "delta_z",
    "delta_ba",
    "delta_out",
    "w_gate",
    "w_up",
    "w_down",
    "delta_norm",
    "delta_conv",
    "delta_dt_bias",
    "delta_a",
    "options",
)
DELTA_MATRICES = ("delta_qkv", "delta_z", "delta_ba", "delta_out", "w_gate", "w_up", "w_down")


class DecoderLayer(nn.Cell):
    """One decoder layer: its weights, its slice of the KV cache, and the prefill/decode bodies."""

    def __init__(
        self,
        checkpoint: Checkpoint,
        index: int,
        cache_rows: int,
        block_size: int,
        kernels: CpuKernels,
        dtype=ms.float32,
        split: TensorSplit = WHOLE_MODEL,
        paged: PagedBackend | None = None,
        cache: CacheFormat | None = None,
        device_target: str = "CPU",
        states: StateSlots = NO_STATES,
    ):
        """paged: the paged attention backend's factory (paged_attention.paged_backend), None: the
        CPU kernels or gather; cache: the KV cache's rows (None: in dtype); device_target: where
        MindSpore's ops run the layer, its int8 products and routed experts run that device's kernels
        (their reference elsewhere); states: the state slots a Gated DeltaNet layer holds."""
        super().__init__()
        spec, p = checkpoint.spec, f"layers.{index}."
        # a rank's checkpoint holds its share already (its loader read only those rows and columns)
        share = LayerShare.of(spec, split).held_as(checkpoint.split, split)
        self._use_kernels(kernels, spec, block_size)
        # Half precision (Ascend/GPU, or float16 on CPU): weights, activations and cache in `dtype`,
        # norms and softmax in float32. A constant: the float32 graphs have no casts at all.
        self.dtype, self.half = dtype, dtype != ms.float32
        self._set_shape(spec, share, split)
        # The fused layer adds wo's and w_down's outputs to the residual itself, so it needs
        # the whole layer (no tensor parallelism) and a hidden size of whole kernel tiles.
        fused = kernels.stack is not None and not self.parallel and spec.hidden_size % MATMUL_TILE == 0
        self.kernel_layer: Any = kernels.stack if fused else None
        features = fused_only_features(spec)
        if features and not fused:
            raise ValueError(
                f"{spec.architecture}: layers with {', '.join(features)} run on the fused CPU kernel only "
                "(runtime.matmul and runtime.decode_attention kernel, float32, a hidden size that is a "
                "multiple of 32, no tensor parallelism)"
            )
        if cache is not None and cache.quantized and not fused:
            raise ValueError(
                "runtime.kv_cache_dtype q8_0 is written and read by the fused CPU layer kernel: it needs "
                "a hidden size that is a multiple of 32 and no tensor parallelism"
            )
        self.local = spec.is_local(index)
        self.nope = index in spec.nope_layers  # its Q and K unrotated: the stack's second tables
        self.delta = spec.is_linear(index)  # a Gated DeltaNet layer: a state per slot, no KV cache
        self.fused_inputs = DELTA_LAYER_INPUTS if self.delta else FUSED_LAYER_INPUTS
        self.attn_norm = param(checkpoint.tensors[p + "attn_norm"], p + "attn_norm")
        self.ffn_norm = param(checkpoint.tensors[p + "ffn_norm"], p + "ffn_norm")
        self.has_bias, self.qk_norm = spec.qkv_bias, spec.qk_norm
        self.int8_products = False  # the linears are int8 products' cells (_load_int8)
        self.hidden = spec.hidden_size
        # A MoE layer: the fused kernel (a zero FFN) or the ops run its attention; its experts run in
        # the CPU kernel's op (ExpertsFfn), or with MindSpore's products in the device's MoE kernels
        self.moe: Any = None
        if spec.is_moe(index) and kernels.matmul is not None:
            self.moe = ExpertsFfn(checkpoint, index, self.eps_tensor, kernels.int8_activations)
        elif spec.is_moe(index):
            self.moe = mindspore_experts(device_target)(checkpoint, index, spec.rms_eps, dtype)
        if self.delta:
            self._load_delta(checkpoint, p, states)
            return
        if fused:
            self._load_fused(checkpoint, p, share)
            self._fused_options(checkpoint, p)
        else:
            self._load_op_by_op(
                checkpoint, p, share, None if kernels.matmul else int8_matmul_cell(device_target)
            )
        self.paged_attention: Any = None
        cache_shape: tuple[int, ...] = (cache_rows, spec.head_dim)
        if paged is not None:
            self.paged_attention = paged(
                heads=self.heads, kv_heads=self.kv_heads, head_dim=spec.head_dim, dtype=dtype
            )
            cache_shape = (
                cache_rows // (self.kv_heads * block_size),
                block_size,
                self.kv_heads,
                spec.head_dim,
            )
        cache_dtype = dtype
        if cache is not None and cache.quantized:
            cache_shape, cache_dtype = (cache_rows, cache.row_width(spec.head_dim)), cache.mindspore_dtype
        self.k_cache = zeros(cache_shape, p + "k_cache", cache_dtype)
        self.v_cache = zeros(cache_shape, p + "v_cache", cache_dtype)
        self.matmul = ops.MatMul()
        self.bmm_t = ops.BatchMatMul(transpose_b=True)
        self.bmm = ops.BatchMatMul()

    def _use_kernels(self, kernels: CpuKernels, spec: ModelSpec, block_size: int) -> None:
        """The CPU kernels this layer calls (None: MindSpore's ops) and their constant inputs."""
        self.attention = kernels.attention
        self.kernel_matmul, self.kernel_matmul_add = kernels.matmul, kernels.matmul_add
        self.kernel_norm, self.kernel_swiglu, self.kernel_rope = kernels.norm, kernels.swiglu, kernels.rope
        # the RMSNorms' epsilon, then the attention scale where the model has its own
        scales = [spec.rms_eps] + ([spec.attention_scale] if spec.attention_scale is not None else [])
        self.eps_tensor = Tensor(np.array(scales, np.float32))
        self.block_size = Tensor(np.array([block_size], np.int32))  # for the attention kernels

    def _set_shape(self, spec: ModelSpec, share: LayerShare, split: TensorSplit) -> None:
        """This rank's heads and FFN columns, and the AllReduce that sums a split layer's products."""
        hd = spec.head_dim
        self.kv_heads, self.group = share.kv_heads, spec.group_size
        self.heads = self.kv_heads * self.group
        self.head_dim, self.eps = hd, spec.rms_eps
        self.q_size = self.heads * hd
        self.kv_size = self.kv_heads * hd
        self.ffn = share.ffn.stop - share.ffn.start
        self.kv_heads_tensor = Tensor(np.array([self.kv_heads], np.int32))  # for the RoPE kernel
        self.parallel = split.size > 1
        # MindSpore ops (untyped), None where unused: the graph code (compiled by MindSpore, where
        # narrowing would add ops) calls them only under the condition that set them.
        self.all_reduce: Any = ops.AllReduce() if self.parallel else None

    def _qkv_bias(self, checkpoint: Checkpoint, p: str, share: LayerShare) -> np.ndarray:
        """This rank's Q, K and V biases as one vector (zeros for a model without them)."""
        if not self.has_bias:
            return np.zeros(self.q_size + 2 * self.kv_size, np.float32)
        rows = (("bq", share.q_rows), ("bk", share.kv_rows), ("bv", share.kv_rows))
        return np.concatenate([checkpoint.tensors[p + b][r] for b, r in rows])

    def _load_fused(self, checkpoint: Checkpoint, p: str, share: LayerShare) -> None:
        """Each matrix in its own format (a GGUF's, float32 tiles otherwise), multiplied by the
        kernel, which applies the attention scale to the queries itself."""
        zero = zero_ffn(self.hidden, p) if self.moe is not None else {}
        for name in MATRICES:
            weights = zero[name] if name in zero else kept_param(checkpoint, p + name, p + name)[0]
            setattr(self, name, weights)
        ids = [int(checkpoint.blocks[p + n].qtype) if p + n in checkpoint.blocks else 0 for n in MATRICES]
        self.formats = Parameter(Tensor(np.array(ids, np.int32)), name=p + "formats", requires_grad=False)
        self.bqkv = param(self._qkv_bias(checkpoint, p, share), p + "bqkv")

    def _load_delta(self, checkpoint: Checkpoint, p: str, states: StateSlots) -> None:
        """A Gated DeltaNet layer's inputs to the fused kernel (DELTA_LAYER_INPUTS): its products in
        their formats (b and a as one float32 matrix, two small rows a value head), its conv, gate
        and norm weights, and its state: each slot's conv inputs and recurrent matrices (live slots,
        then snapshots), and each live slot's held rows, all written in place by the kernel."""
        shape = checkpoint.spec.linear_attention
        assert shape is not None
        for name in ("delta_qkv", "delta_z", "delta_out"):
            setattr(self, name, kept_param(checkpoint, p + name, p + name)[0])
        zero = zero_ffn(self.hidden, p) if self.moe is not None else {}
        for name in ("w_gate", "w_up", "w_down"):
            setattr(self, name, zero[name] if name in zero else kept_param(checkpoint, p + name, p + name)[0])
        ba = np.concatenate([checkpoint.matrix(p + "delta_beta"), checkpoint.matrix(p + "delta_alpha")])
        self.delta_ba = Parameter(
            Tensor(BlockMatrix.from_float(ba).packed), name=p + "delta_ba", requires_grad=False
        )
        ids = [
            int(checkpoint.blocks[p + n].qtype) if p + n in checkpoint.blocks else 0 for n in DELTA_MATRICES
        ]
        self.formats = Parameter(Tensor(np.array(ids, np.int32)), name=p + "formats", requires_grad=False)
        width = shape.channels + 2 * shape.value_heads  # a held row: its conv inputs, b and a
        self.held = zeros((states.live, max(states.held_rows * width, 1)), p + "held", ms.float32)
        # tap-major [K, C]: the kernel convolves eight channels at a time
        conv = checkpoint.tensors[p + "delta_conv"].reshape(shape.channels, shape.conv_kernel)
        self.delta_conv = param(conv.T.reshape(-1), p + "delta_conv")
        for name in ("delta_norm", "delta_dt_bias", "delta_a"):
            setattr(self, name, param(checkpoint.tensors[p + name].reshape(-1), p + name))
        self.conv_state = zeros((states.total, shape.conv_state), p + "conv_state", ms.float32)
        self.recurrent_state = zeros((states.total, shape.recurrent_state), p + "recurrent_state", ms.float32)
        options = [0, 0, 0, 0, 0, 0, 0, 1, 0]  # kind 1: a Gated DeltaNet layer
        self.options = Parameter(Tensor(np.array(options, np.int32)), name=p + "options", requires_grad=False)
        self.delta_inputs = tuple(getattr(self, name) for name in DELTA_LAYER_INPUTS)  # fused()'s
        self.k_cache = self.v_cache = None  # its state is in delta_inputs

    def _fused_options(self, checkpoint: Checkpoint, p: str) -> None:
        """The fused kernel's options of this layer (window, local, GeGLU, QK-norm, post-norms, head
        size, output gate, kind, bidirectional) and their weights: QK-norm and post-norm weights
        ([1], unread, where the layer has none)."""
        spec = checkpoint.spec
        none = np.ones(1, np.float32)
        for name in ("q_norm", "k_norm", "post_attn_norm", "post_ffn_norm"):
            setattr(self, name, param(checkpoint.tensors.get(p + name, none), p + name))
        options = [
            spec.sliding_window if self.local else 0,
            int(self.local or self.nope),
            int(spec.activation == "gelu_tanh"),
            int(spec.qk_norm),
            int(spec.post_norms),
            spec.head_dim if spec.rope_dims != spec.head_dim else 0,  # partial RoPE: the head's size
            int(spec.output_gate),
            0,  # kind: attention
            int(spec.bidirectional),
        ]
        self.options = Parameter(Tensor(np.array(options, np.int32)), name=p + "options", requires_grad=False)

    def _load_op_by_op(
        self, checkpoint: Checkpoint, p: str, share: LayerShare, int8_matmul: type[Int8Matmul] | None
    ) -> None:
        """This rank's rows and columns as float matrices [in, out], Q/K/V and gate/up each one
        product; packed in tiles when the matmul kernel runs them. The attention scale is folded
        into the Q rows and bias (RoPE is linear, so this commutes), with QK-norm into q_norm."""
        scale = checkpoint.spec.query_scale
        if self.qk_norm:
            # The norm would undo a scale folded into the Q rows: it goes into q_norm's weights, which
            # every rank holds whole (per head, so each rank norms its own heads with them).
            self.q_norm = param(checkpoint.tensors[p + "q_norm"] * scale, p + "q_norm")
            self.k_norm = param(checkpoint.tensors[p + "k_norm"], p + "k_norm")
            scale = 1.0
        if int8_matmul is not None and self._load_int8(checkpoint, p, scale, share, int8_matmul):
            return
        # a MoE layer's FFN is its experts' (ExpertsFfn)
        names = MATRICES[:4] if self.moe is not None else MATRICES
        t = {name: checkpoint.matrix(p + name) for name in names}
        q, kv, ffn = share.q_rows, share.kv_rows, share.ffn
        self.wqkv = self._weight(np.concatenate([t["wq"][q] * scale, t["wk"][kv], t["wv"][kv]]).T, p + "wqkv")
        bias = self._qkv_bias(checkpoint, p, share)
        bias[: self.q_size] *= scale
        self.bqkv = param(bias, p + "bqkv", self.dtype)
        self.wo = self._weight(t["wo"][:, q].T, p + "wo")
        if self.moe is not None:
            return
        self.w_gate_up = self._weight(np.concatenate([t["w_gate"][ffn], t["w_up"][ffn]]).T, p + "w_gate_up")
        self.w_down = self._weight(t["w_down"][:, ffn].T, p + "w_down")

    def _load_int8(
        self, checkpoint: Checkpoint, p: str, scale: float, share: LayerShare, cell: type[Int8Matmul]
    ) -> bool:
        """An int8 checkpoint's linears as quantized products (agent/graphs/quant_matmul.py: Ascend's
        QuantBatchMatmul or WeightQuantBatchMatmul, their reference elsewhere) where MindSpore's ops
        run this whole layer; True when they do. A static (W8A8) product's quant_bias holds the Q/K/V
        bias, scaled with the Q rows like their dequantization."""
        if self.parallel or p + "wq" not in checkpoint.int8:
            return False
        self.int8_products = True
        self.wqkv = cell.of(
            checkpoint, [p + n for n in ("wq", "wk", "wv")], p + "wqkv", self.dtype, [scale, 1, 1]
        )
        if self.wqkv.scheme == "static":
            self.has_bias = False
        else:
            bias = self._qkv_bias(checkpoint, p, share)
            bias[: self.q_size] *= scale
            self.bqkv = param(bias, p + "bqkv", self.dtype)
        self.wo = cell.of(checkpoint, [p + "wo"], p + "wo", self.dtype)
        if self.moe is None:
            self.w_gate_up = cell.of(checkpoint, [p + "w_gate", p + "w_up"], p + "w_gate_up", self.dtype)
            self.w_down = cell.of(checkpoint, [p + "w_down"], p + "w_down", self.dtype)
        return True

    def _weight(self, w: np.ndarray, name: str) -> Parameter:
        return param(pack_for_kernel(w) if self.kernel_matmul is not None else w, name, self.dtype)

    def linear(self, x, w, n: int):
        """x [M, K] @ w -> [M, n] (w: an int8 product's cell, where the layer has them)."""
        if self.int8_products:
            return w(x)
        if self.kernel_matmul is None:
            return self.matmul(x, w)
        y = self.kernel_matmul(x, w)
        return y if n % MATMUL_TILE == 0 else y[:, :n]

    def add_projected(self, residual, x, w, n: int):
        """residual + x @ w, the product summed over the group's ranks when this layer is split."""
        if self.kernel_matmul_add is not None and not self.parallel and n % MATMUL_TILE == 0:
            return self.kernel_matmul_add(x, w, residual)
        y = self.linear(x, w, n)
        return residual + (self.all_reduce(y) if self.parallel else y)

    def softmax(self, scores, mask):
        """softmax(scores + mask) over the last axis; the mask is float32 from the host."""
        if self.half:
            return ops.cast(ops.softmax(ops.cast(scores, ms.float32) + mask, -1), self.dtype)
        return ops.softmax(scores + mask, -1)

    def qkv(self, x, cos, sin, rot):
        """Norm, fused QKV projection and RoPE on Q and K together. x: [N, D]; cos/sin: [N, 1, hd]."""
        h = rms_norm(x, self.attn_norm, self.eps, self.dtype, self.half, self.kernel_norm, self.eps_tensor)
        qkv = self.linear(h, self.wqkv, self.q_size + 2 * self.kv_size)
        if self.has_bias:
            qkv = qkv + self.bqkv
        if self.qk_norm:
            qkv = self.norm_heads(qkv)
        if self.kernel_rope is not None:
            heads = self.kernel_rope(qkv, cos, sin, self.kv_heads_tensor)  # [N, heads + 2 KV, hd]
            return ops.split(heads, [self.heads, self.kv_heads, self.kv_heads], 1)
        qk, v = ops.split(qkv, [self.q_size + self.kv_size, self.kv_size], 1)
        # rotate-half as one 2-D product: a [N, heads, hd] @ [hd, hd] product broadcast R per layer
        rotated = ops.reshape(
            self.matmul(ops.reshape(qk, (-1, self.head_dim)), rot),
            (-1, self.heads + self.kv_heads, self.head_dim),
        )
        qk = ops.reshape(qk, (-1, self.heads + self.kv_heads, self.head_dim))
        qk = qk * cos + rotated * sin
        q, k = ops.split(qk, [self.heads, self.kv_heads], 1)
        return q, k, ops.reshape(v, (-1, self.kv_heads, self.head_dim))

    def norm_heads(self, qkv):
        """QK-norm: each query and key head of qkv [N, Q + 2 KV] RMS-normed over head_dim by q_norm
        and k_norm (the queries' scale folded in), before RoPE; V as it is."""
        q, k, v = ops.split(qkv, [self.q_size, self.kv_size, self.kv_size], 1)
        norm = (self.eps, self.dtype, self.half, self.kernel_norm, self.eps_tensor)
        q = rms_norm(ops.reshape(q, (-1, self.head_dim)), self.q_norm, *norm)
        k = rms_norm(ops.reshape(k, (-1, self.head_dim)), self.k_norm, *norm)
        return ops.concat((ops.reshape(q, (-1, self.q_size)), ops.reshape(k, (-1, self.kv_size)), v), 1)

    def mlp(self, x):
        h = rms_norm(x, self.ffn_norm, self.eps, self.dtype, self.half, self.kernel_norm, self.eps_tensor)
        gate_up = self.linear(h, self.w_gate_up, 2 * self.ffn)
        if self.kernel_swiglu is not None:
            return self.add_projected(x, self.kernel_swiglu(gate_up), self.w_down, self.hidden)
        gate, up = ops.split(gate_up, self.ffn, 1)
        return self.add_projected(x, ops.silu(gate) * up, self.w_down, self.hidden)

    def feed_forward(self, x, rows):
        """x plus the FFN's output: the dense one (mlp), or the experts' (MoeFfn), a rank's share of
        every expert's columns summed over the group. rows: int32 [N * KV] or [N], every row computed
        by the experts' op (a padding row's output unread)."""
        if self.moe is None:
            return self.mlp(x)
        out = self.moe(x, ops.ones_like(rows))
        # the op adds its experts' sum to x itself: each rank's part is its output less x
        return x + self.all_reduce(out - x) if self.parallel else out

    def fused(self, x, cos, sin, write_idx, lengths, tables, row_table, k_cache, v_cache, states):
        """The whole layer in one kernel (agent/kernels/fused_layer.cc FusedStack with one layer): x
        [N, D]; write_idx and lengths [N*KV] (row-major): each (row, KV head)'s cache row and
        positions attended, 0 for padding rows; tables [T, MB] block tables, row_table [N] each row's
        table; states: each table's state slot and moves (DecoderModel.state_moves), read by a
        Gated DeltaNet layer, whose state takes the caches' places. (A model with local or NoPE
        layers runs as a stack: DecoderModel.run_stack.)"""
        step = (x, cos, sin, write_idx, lengths, self.eps_tensor, tables, row_table, self.block_size)
        if self.delta:
            return self.kernel_layer(*step, cos, sin, write_idx, tables, states, *self.delta_inputs)
        return self.kernel_layer(
            *step,
            cos,
            sin,
            write_idx,
            tables,
            states,
            self.attn_norm,
            self.bqkv,
            k_cache,
            v_cache,
            self.ffn_norm,
            self.formats,
            self.wq,
            self.wk,
            self.wv,
            self.wo,
            self.w_gate,
            self.w_up,
            self.w_down,
            self.q_norm,
            self.k_norm,
            self.post_attn_norm,
            self.post_ffn_norm,
            self.options,
        )

    def paged(self, x, cos, sin, rot, paging, k_cache, v_cache, prompt: bool):
        """The layer through the paged backend: x [N, D]; paging: the step's slot_mapping,
        batch_valid_length, q_seq_lens, block_tables and attn_mask (agent/graphs/paged_attention.py),
        the same for prompts, chunks, mixed steps and decode; prompt: every sequence starts at
        position 0 (the prefill phase: attention over the rows' own K/V)."""
        slot_mapping, batch_valid_length, q_seq_lens, block_tables, attn_mask = paging
        q, k, v = self.qkv(x, cos, sin, rot)
        written = self.paged_attention.write(k, v, k_cache, v_cache, slot_mapping)
        q = ops.depend(q, written)  # the read after the write, as vllm-mindspore orders them
        if prompt:
            out = self.paged_attention.prompt(q, k, v, batch_valid_length, q_seq_lens, attn_mask)
        else:
            out = self.paged_attention.attend(
                q, k_cache, v_cache, block_tables, batch_valid_length, q_seq_lens, attn_mask
            )
        return self.feed_forward(self.add_projected(x, out, self.wo, self.hidden), slot_mapping)

    def prefill(self, x, cos, sin, rot, write_idx, mask, tables, row_table, k_cache, v_cache, states):
        """x: [S, D] one prompt; write_idx: [KV*S] cache rows (head-major); mask: [G*S, S]: the
        prompt attends to itself (it starts at position 0). Fused: write_idx and mask are the
        kernel's row-major write rows and lengths [S*KV], and the rows attend through the block
        table (tables [1, MB], row_table [S] zeros), so a prompt chunk sees the positions cached
        before it. The caches are this layer's own Parameters, or graph inputs in an exported
        MindIR graph; states: the fused kernel's state slots and moves (DecoderModel.state_moves)."""
        if self.kernel_layer is not None:
            x = self.fused(x, cos, sin, write_idx, mask, tables, row_table, k_cache, v_cache, states)
            return x if self.moe is None else self.moe(x, mask)
        q, k, v = self.qkv(x, cos, sin, rot)
        k = ops.transpose(k, (1, 0, 2))  # [KV, S, hd]
        v = ops.transpose(v, (1, 0, 2))
        ops.scatter_update(k_cache, write_idx, ops.reshape(k, (-1, self.head_dim)))
        ops.scatter_update(v_cache, write_idx, ops.reshape(v, (-1, self.head_dim)))
        q = ops.reshape(q, (-1, self.kv_heads, self.group, self.head_dim))
        q = ops.reshape(ops.transpose(q, (1, 2, 0, 3)), (self.kv_heads, -1, self.head_dim))
        probs = self.softmax(self.bmm_t(q, k), mask)  # [KV, G*S, S]
        out = ops.reshape(self.bmm(probs, v), (self.kv_heads, self.group, -1, self.head_dim))
        out = ops.reshape(ops.transpose(out, (2, 0, 1, 3)), (-1, self.q_size))
        return self.feed_forward(self.add_projected(x, out, self.wo, self.hidden), write_idx)

    def decode(self, x, cos, sin, rot, write_idx, where, extent, row_table, k_cache, v_cache, states):
        """x: [B, D]; write_idx: [B*KV]. With the attention kernel: where = block tables [B, MB],
        extent = positions to attend [B*KV], row_table [B] = 0..B-1. Without: where = rows to
        attend [B*KV, L], extent = mask [B*KV, 1, L] over an attend bucket (row_table unused);
        states as prefill's."""
        if self.kernel_layer is not None:
            x = self.fused(x, cos, sin, write_idx, extent, where, row_table, k_cache, v_cache, states)
            return x if self.moe is None else self.moe(x, extent)
        q, k, v = self.qkv(x, cos, sin, rot)
        ops.scatter_update(k_cache, write_idx, ops.reshape(k, (-1, self.head_dim)))
        ops.scatter_update(v_cache, write_idx, ops.reshape(v, (-1, self.head_dim)))
        q = ops.reshape(q, (-1, self.group, self.head_dim))  # [B*KV, G, hd]
        if self.attention is None:
            keys = ops.gather(k_cache, where, 0)  # [B*KV, L, hd]
            values = ops.gather(v_cache, where, 0)
            probs = self.softmax(self.bmm_t(q, keys), extent)  # [B*KV, G, L]
            out = self.bmm(probs, values)
        else:
            out = self.attention(q, k_cache, v_cache, where, self.block_size, extent)
        out = ops.reshape(out, (-1, self.q_size))
        return self.feed_forward(self.add_projected(x, out, self.wo, self.hidden), write_idx)
