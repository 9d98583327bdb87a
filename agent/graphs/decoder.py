"""The decoder-only transformer in MindSpore, as the LLaMA family shapes it: its layers, their weights
(kept in their file's block formats for the CPU kernels) and the KV cache, as Parameters that every
graph of agent/graphs/step_graphs.py shares.

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

Tensor parallelism (TensorSplit): each rank of a group holds a contiguous run of KV heads with their
query heads (Q/K/V rows, the matching columns of wo, its own KV cache) and of FFN columns (gate/up
rows, down columns); an AllReduce inside the graph sums the partial outputs of wo and w_down. The
embedding, norms and lm_head are whole on every rank, so every rank computes the same logits.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import dataclasses
from dataclasses import dataclass
from typing import Any

import mindspore as ms
import numpy as np
from mindspore import Parameter, Tensor, nn, ops
from mindspore.common.initializer import Zero

from agent.kernels import op_path
from agent.model.checkpoint import Checkpoint
from agent.model.quantized import BlockMatrix
from agent.model.spec import ModelSpec


def rope_tables(
    spec: ModelSpec, max_len: int, local: bool = False
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """cos and signed sin tables [max_len, head_dim] and the rotate-half matrix R, so that
    rope(x) = x * cos + (x @ R) * sin, with x @ R = concat(x2, x1) and the sign folded into sin;
    `local`: the sliding-window layers' frequencies."""
    hd = spec.head_dim
    angles = np.outer(np.arange(max_len, dtype=np.float64), spec.rope_inv_freq(local))  # [max_len, hd/2]
    cos = np.concatenate([np.cos(angles)] * 2, axis=1)
    sin = np.concatenate([-np.sin(angles), np.sin(angles)], axis=1)
    half = hd // 2
    rot = np.zeros((hd, hd), np.float32)
    rot[np.arange(half) + half, np.arange(half)] = 1.0  # out[:half] = x[half:]
    rot[np.arange(half), np.arange(half) + half] = 1.0  # out[half:] = x[:half]
    return cos.astype(np.float32), sin.astype(np.float32), rot


@dataclass(frozen=True)
class TensorSplit:
    """This process's share of a tensor-parallel group (rank of size); size 1: the whole model."""

    rank: int = 0
    size: int = 1

    def share(self, total: int) -> tuple[int, int]:
        """[start, end) of this rank's contiguous share of `total` items (the first ranks get the
        remainder: 3 KV heads over 2 ranks are 2 + 1)."""
        base, extra = divmod(total, self.size)
        start = self.rank * base + min(self.rank, extra)
        return start, start + base + (self.rank < extra)


WHOLE_MODEL = TensorSplit()  # no tensor parallelism: the process runs the whole model


def _param(array: np.ndarray, name: str, dtype=ms.float32) -> Parameter:
    return Parameter(
        Tensor(np.ascontiguousarray(array, dtype=np.float32), dtype=dtype), name=name, requires_grad=False
    )


def _zeros(shape: tuple[int, ...], name: str, dtype) -> Parameter:
    """A Parameter of zeros that MindSpore allocates itself: the KV cache, GBs that a numpy array
    copied twice into (3.5 GB: 6.5 s of an agent's start); its pages are touched as the cache fills."""
    param = Parameter(Tensor(shape=shape, dtype=dtype, init=Zero()), name=name, requires_grad=False)
    param.init_data()
    return param


def release_freed_memory() -> None:
    """Give the pages of freed heap memory back to the system (glibc's malloc_trim). The loader's
    packed matrices are copied into Parameters and freed; glibc had served the later, weight-sized
    ones from its heap (its mmap threshold rises with each large free), whose holes it keeps: 530 MB
    of a 7B model's resident memory."""
    libc = ctypes.util.find_library("c")
    if libc is not None and hasattr(ctypes.CDLL(libc), "malloc_trim"):
        ctypes.CDLL(libc).malloc_trim(0)


def _kept_param(checkpoint: Checkpoint, name: str, param_name: str) -> tuple[Parameter, Parameter]:
    """A matrix packed for the kernels' products (product.h) as a Parameter (uint8, or float32 for a
    float matrix) and its format id as an int32 [1] Parameter. A matrix the checkpoint keeps in its
    format is then held once: the checkpoint's entry becomes a view of the Parameter's memory."""
    kept = checkpoint.blocks.get(name)
    matrix = kept if kept is not None else BlockMatrix.from_float(checkpoint.tensors[name])
    weights = Parameter(Tensor(matrix.packed), name=param_name, requires_grad=False)
    if kept is not None:
        checkpoint.blocks[name] = dataclasses.replace(kept, packed=weights.asnumpy())
    return weights, Parameter(Tensor(np.array([matrix.qtype], np.int32)), name=f"{param_name}_format")


def rms_norm(x, weight, eps: float, dtype, half: bool, kernel=None, eps_tensor=None):
    """x / rms(x) * weight over the last axis; in half precision computed in float32 and cast back
    to `dtype` (a square of a large float16 activation overflows). `kernel`: the float32 CPU kernel
    (agent/kernels/elementwise.cc), called with `eps_tensor` [1]."""
    if kernel is not None:
        return kernel(x, weight, eps_tensor)
    if half:
        x = ops.cast(x, ms.float32)
        return ops.cast(x * ops.rsqrt(ops.mean(ops.square(x), -1, True) + eps) * weight, dtype)
    return x * ops.rsqrt(ops.mean(ops.square(x), -1, True) + eps) * weight


MATMUL_TILE = 32  # columns per packed tile of agent/kernels/skinny_matmul.cc


def pack_for_kernel(w: np.ndarray) -> np.ndarray:
    """[K, N] -> [ceil(N / TILE), K, TILE], zero columns padding N: each tile one contiguous stream."""
    k, n = w.shape
    tiles = -(-n // MATMUL_TILE)
    padded = np.zeros((k, tiles * MATMUL_TILE), np.float32)
    padded[:, :n] = w
    return padded.reshape(k, tiles, MATMUL_TILE).transpose(1, 0, 2)


class CpuKernels:
    """The custom CPU ops (agent/kernels) the graphs call instead of MindSpore's: the decode
    attention, and with the matmul kernel also RMSNorm, SwiGLU, RoPE and the product + residual,
    and with both a whole layer as one op (prefill and decode) where the layer's shapes allow (`layer`).
    None where MindSpore's own ops run."""

    def __init__(
        self, attention: bool, matmul: bool, head_dim: int, hidden: int, int8_activations: bool = False
    ):
        def custom(function: str, out_shape, out_dtype=lambda x, *_: x):
            return ops.Custom(op_path(function), out_shape=out_shape, out_dtype=out_dtype, func_type="aot")

        self.attention = custom("DecodeAttention", lambda q, *_: q) if attention else None
        # Layers as one op (fused_layer.cc FusedStack: one layer, or all of them); runtime.activations
        # int8: the integer formats' products take int8 activations, the LM head's too.
        suffix = "I8" if int8_activations else ""
        self.stack = custom(f"FusedStack{suffix}", lambda x, *_: x) if attention and matmul else None
        self.matmul = self.matmul_add = self.matmul_format = self.rows = None
        self.norm = self.swiglu = self.rope = None
        if matmul:
            self.matmul = custom("SkinnyMatMul", lambda x, w: [x[0], w[0] * w[2]])
            # products and embedding rows of a matrix in any format (product.h), with its format id
            self.matmul_format = custom(
                f"SkinnyMatMulFormat{suffix}", lambda x, w, f: [x[0], w[0] * MATMUL_TILE]
            )
            self.rows = custom("MatrixRows", lambda ids, *_: [ids[0], hidden], lambda ids, w, f: ms.float32)
            self.matmul_add = custom("SkinnyMatMulAdd", lambda x, w, r: r)
            self.norm = custom("RmsNorm", lambda x, *_: x)
            self.swiglu = custom("SwiGlu", lambda x: [x[0], x[1] // 2])
            self.rope = custom("Rope", lambda x, *_: [x[0], x[1] // head_dim, head_dim])


def gemma_traits(spec: ModelSpec) -> list[str]:
    """What of a model's layers only the fused kernel computes (Gemma 3's): empty for the LLaMA family."""
    traits = {
        "QK-norm": spec.qk_norm,
        "post-norms": spec.post_norms,
        "GeGLU": spec.activation != "silu",
        "sliding-window layers": bool(spec.local_layers and spec.sliding_window),
        "scaled embeddings": spec.embed_scale != 1.0,
    }
    return [name for name, present in traits.items() if present]


class LlamaLayer(nn.Cell):
    """One decoder layer: its weights, its slice of the KV cache, and the prefill/decode bodies. The
    LLaMA family's layers run op by op or as one kernel; Gemma 3's (QK-norm, four norms, GeGLU, a
    sliding window on local layers) as one kernel only (fused_layer.cc's options)."""

    MATRICES = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")

    def __init__(
        self,
        checkpoint: Checkpoint,
        index: int,
        cache_rows: int,
        block_size: int,
        kernels: CpuKernels,
        dtype=ms.float32,
        split: TensorSplit = TensorSplit(),
    ):
        super().__init__()
        spec = checkpoint.spec
        self.attention = kernels.attention
        self.kernel_matmul, self.kernel_matmul_add = kernels.matmul, kernels.matmul_add
        self.kernel_norm, self.kernel_swiglu, self.kernel_rope = kernels.norm, kernels.swiglu, kernels.rope
        # the RMSNorms' epsilon, then the attention scale where the model has its own
        scales = [spec.rms_eps] + ([spec.attention_scale] if spec.attention_scale is not None else [])
        self.eps_tensor = Tensor(np.array(scales, np.float32))
        # Half precision (Ascend/GPU, or float16 on CPU): weights, activations and cache in `dtype`,
        # norms and softmax in float32. A constant: the float32 graphs have no casts at all.
        self.dtype, self.half = dtype, dtype != ms.float32
        p = f"layers.{index}."
        hd, group = spec.head_dim, spec.group_size
        kv_start, kv_end = split.share(spec.num_kv_heads)
        q_rows = slice(kv_start * group * hd, kv_end * group * hd)  # this rank's heads' rows
        kv_rows = slice(kv_start * hd, kv_end * hd)
        ffn_start, ffn_end = split.share(spec.intermediate_size)
        scale = spec.query_scale
        self.kv_heads, self.group = kv_end - kv_start, group
        self.heads = self.kv_heads * group
        self.head_dim, self.eps = hd, spec.rms_eps
        self.block_size = Tensor(np.array([block_size], np.int32))  # for the attention kernels
        self.q_size = self.heads * hd
        self.kv_size = self.kv_heads * hd
        self.ffn = ffn_end - ffn_start
        self.kv_heads_tensor = Tensor(np.array([self.kv_heads], np.int32))  # for the RoPE kernel
        self.parallel = split.size > 1
        # MindSpore ops (untyped), None where unused: the graph code (compiled by MindSpore, where
        # narrowing would add ops) calls them only under the condition that set them.
        self.all_reduce: Any = ops.AllReduce() if self.parallel else None
        # The fused layer adds wo's and w_down's outputs to the residual itself, so it needs
        # the whole layer (no tensor parallelism) and a hidden size of whole kernel tiles.
        fused = kernels.stack is not None and not self.parallel and spec.hidden_size % MATMUL_TILE == 0
        self.kernel_layer: Any = kernels.stack if fused else None
        traits = gemma_traits(spec)
        if traits and not fused:
            raise ValueError(
                f"{spec.architecture}: layers with {', '.join(traits)} run on the fused CPU kernel only "
                "(runtime.matmul and runtime.decode_attention kernel, float32, a hidden size that is a "
                "multiple of 32, no tensor parallelism)"
            )
        self.local = spec.is_local(index)
        self.attn_norm = _param(checkpoint.tensors[p + "attn_norm"], p + "attn_norm")
        self.ffn_norm = _param(checkpoint.tensors[p + "ffn_norm"], p + "ffn_norm")
        self.has_bias = spec.qkv_bias
        bias = (
            np.concatenate(
                [
                    checkpoint.tensors[p + b][rows]
                    for b, rows in (("bq", q_rows), ("bk", kv_rows), ("bv", kv_rows))
                ]
            )
            if spec.qkv_bias
            else np.zeros(self.q_size + 2 * self.kv_size, np.float32)
        )
        self.hidden = spec.hidden_size
        if fused:
            # Each matrix in its own format (a GGUF's, float32 tiles otherwise), multiplied by the
            # kernel, which applies the attention scale to the queries itself.
            for name in self.MATRICES:
                weights, _ = _kept_param(checkpoint, p + name, p + name)
                setattr(self, name, weights)
            ids = [
                int(checkpoint.blocks[p + n].qtype) if p + n in checkpoint.blocks else 0
                for n in self.MATRICES
            ]
            self.formats = Parameter(Tensor(np.array(ids, np.int32)), name=p + "formats", requires_grad=False)
            self.bqkv = _param(bias, p + "bqkv")
            # Gemma's: QK-norm and post-norm weights ([1], unread, where the layer has none), options
            none = np.ones(1, np.float32)
            for name in ("q_norm", "k_norm", "post_attn_norm", "post_ffn_norm"):
                setattr(self, name, _param(checkpoint.tensors.get(p + name, none), p + name))
            options = [
                spec.sliding_window if self.local else 0,
                int(self.local),
                int(spec.activation == "gelu_tanh"),
                int(spec.qk_norm),
                int(spec.post_norms),
            ]
            self.options = Parameter(
                Tensor(np.array(options, np.int32)), name=p + "options", requires_grad=False
            )
        else:
            t = {name: checkpoint.matrix(p + name) for name in self.MATRICES}
            t.update(
                wq=t["wq"][q_rows],
                wk=t["wk"][kv_rows],
                wv=t["wv"][kv_rows],
                wo=t["wo"][:, q_rows],
                w_gate=t["w_gate"][ffn_start:ffn_end],
                w_up=t["w_up"][ffn_start:ffn_end],
                w_down=t["w_down"][:, ffn_start:ffn_end],
            )
            # [in, out]; packed in tiles when the matmul kernel runs them. The attention scale is
            # folded into the Q rows (RoPE is linear, so this commutes).
            self.wqkv = self._weight(np.concatenate([t["wq"] * scale, t["wk"], t["wv"]]).T, p + "wqkv")
            bias[: self.q_size] *= scale
            self.bqkv = _param(bias, p + "bqkv", dtype)
            self.wo = self._weight(t["wo"].T, p + "wo")
            self.w_gate_up = self._weight(np.concatenate([t["w_gate"], t["w_up"]]).T, p + "w_gate_up")
            self.w_down = self._weight(t["w_down"].T, p + "w_down")
        self.k_cache = _zeros((cache_rows, spec.head_dim), p + "k_cache", dtype)
        self.v_cache = _zeros((cache_rows, spec.head_dim), p + "v_cache", dtype)
        self.matmul = ops.MatMul()
        self.bmm_t = ops.BatchMatMul(transpose_b=True)
        self.bmm = ops.BatchMatMul()

    def _weight(self, w: np.ndarray, name: str) -> Parameter:
        return _param(pack_for_kernel(w) if self.kernel_matmul is not None else w, name, self.dtype)

    def linear(self, x, w, n: int):
        """x [M, K] @ w -> [M, n]."""
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

    def mlp(self, x):
        h = rms_norm(x, self.ffn_norm, self.eps, self.dtype, self.half, self.kernel_norm, self.eps_tensor)
        gate_up = self.linear(h, self.w_gate_up, 2 * self.ffn)
        if self.kernel_swiglu is not None:
            return self.add_projected(x, self.kernel_swiglu(gate_up), self.w_down, self.hidden)
        gate, up = ops.split(gate_up, self.ffn, 1)
        return self.add_projected(x, ops.silu(gate) * up, self.w_down, self.hidden)

    def fused(self, x, cos, sin, write_idx, lengths, tables, row_table, k_cache, v_cache):
        """The whole layer in one kernel (agent/kernels/fused_layer.cc FusedStack with one layer): x
        [N, D]; write_idx and lengths [N*KV] (row-major): each (row, KV head)'s cache row and
        positions attended, 0 for padding rows; tables [T, MB] block tables, row_table [N] each row's
        table. (A model with local layers runs as a stack: LlamaModel.run_stack.)"""
        return self.kernel_layer(
            x,
            cos,
            sin,
            write_idx,
            lengths,
            self.eps_tensor,
            tables,
            row_table,
            self.block_size,
            cos,
            sin,
            write_idx,
            tables,
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

    def prefill(self, x, cos, sin, rot, write_idx, mask, tables, row_table, k_cache, v_cache):
        """x: [S, D] one prompt; write_idx: [KV*S] cache rows (head-major); mask: [G*S, S]: the
        prompt attends to itself (it starts at position 0). Fused: write_idx and mask are the
        kernel's row-major write rows and lengths [S*KV], and the rows attend through the block
        table (tables [1, MB], row_table [S] zeros), so a prompt chunk sees the positions cached
        before it. The caches are this layer's own Parameters, or graph inputs in an exported
        MindIR graph."""
        if self.kernel_layer is not None:
            return self.fused(x, cos, sin, write_idx, mask, tables, row_table, k_cache, v_cache)
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
        return self.mlp(self.add_projected(x, out, self.wo, self.hidden))

    def decode(self, x, cos, sin, rot, write_idx, where, extent, row_table, k_cache, v_cache):
        """x: [B, D]; write_idx: [B*KV]. With the attention kernel: where = block tables [B, MB],
        extent = positions to attend [B*KV], row_table [B] = 0..B-1. Without: where = rows to
        attend [B*KV, L], extent = mask [B*KV, 1, L] over an attend bucket (row_table unused)."""
        if self.kernel_layer is not None:
            return self.fused(x, cos, sin, write_idx, extent, where, row_table, k_cache, v_cache)
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
        return self.mlp(self.add_projected(x, out, self.wo, self.hidden))


class LlamaModel(nn.Cell):
    """Weights, RoPE tables and KV cache, shared by the prefill and decode graphs."""

    def __init__(
        self,
        checkpoint: Checkpoint,
        num_blocks: int,
        block_size: int,
        max_len: int,
        kernels: CpuKernels,
        dtype=ms.float32,
        split: TensorSplit = TensorSplit(),
        local_blocks: int = 0,
    ):
        """num_blocks of block_size positions in the KV cache (agent/graphs/interface.py); max_len:
        the positions of the RoPE tables; local_blocks: the blocks of the sliding-window layers' own
        caches (every seat's ring, interface.local_ring_blocks), 0: they take the pool's."""
        super().__init__()
        spec, tensors = checkpoint.spec, checkpoint.tensors
        self.spec = spec
        start, end = split.share(spec.num_kv_heads)
        self.kv_heads = end - start  # this rank's
        cache_rows = num_blocks * self.kv_heads * block_size
        local_rows = local_blocks * self.kv_heads * block_size
        self.kernel_norm = kernels.norm
        self.eps_tensor = Tensor(np.array([spec.rms_eps], np.float32))
        self.layers = nn.CellList(
            [
                LlamaLayer(
                    checkpoint,
                    i,
                    local_rows if local_rows and spec.is_local(i) else cache_rows,
                    block_size,
                    kernels,
                    dtype,
                    split,
                )
                for i in range(spec.num_layers)
            ]
        )
        self.dtype, self.half = dtype, dtype != ms.float32
        # Every layer fused: the whole stack is one op a step (FusedStack, which takes each layer's
        # inputs in a row) instead of one op a layer.
        fused = all(layer.kernel_layer is not None for layer in self.layers)
        self.stack: Any = kernels.stack if fused else None
        self.stack_inputs = tuple(
            p
            for layer in (self.layers if self.stack is not None else ())
            for p in (
                layer.attn_norm,
                layer.bqkv,
                layer.k_cache,
                layer.v_cache,
                layer.ffn_norm,
                layer.formats,
                layer.wq,
                layer.wk,
                layer.wv,
                layer.wo,
                layer.w_gate,
                layer.w_up,
                layer.w_down,
                layer.q_norm,
                layer.k_norm,
                layer.post_attn_norm,
                layer.post_ffn_norm,
                layer.options,
            )
        )
        head = "embed" if spec.tied_embeddings else "lm_head"
        # With the matmul kernel the embedding and LM head stay in their format (a GGUF's, float32
        # tiles otherwise): the embedding's rows are read by MatrixRows, the LM head multiplied by
        # SkinnyMatMulFormat (its I8 twin under int8 activations), and a tied embedding is one matrix
        # for both.
        self.kernel_matmul_format: Any = kernels.matmul_format
        self.kernel_rows: Any = kernels.rows
        self.kept = kernels.matmul_format is not None and not self.half
        if self.kept:
            self.embed, self.embed_format = _kept_param(checkpoint, "embed", "embed")
            self.lm_head, self.lm_head_format = (
                (self.embed, self.embed_format) if head == "embed" else _kept_param(checkpoint, head, head)
            )
        else:
            self.embed = _param(checkpoint.matrix("embed"), "embed", dtype)
            self.lm_head = (
                self.embed if spec.tied_embeddings else _param(checkpoint.matrix("lm_head"), "lm_head", dtype)
            )
        self.final_norm = _param(tensors["final_norm"], "final_norm")
        cos, sin, rot = rope_tables(spec, max_len)
        self.cos, self.sin = _param(cos, "rope_cos", dtype), _param(sin, "rope_sin", dtype)
        self.rot = _param(rot, "rope_rot", dtype)
        # Sliding-window layers with a RoPE base of their own (Gemma 3's 10,000 beside 1,000,000)
        self.local_rope = bool(spec.local_layers and spec.rope_local_theta is not None)
        if self.local_rope:
            cos, sin, _ = rope_tables(spec, max_len, local=True)
            self.cos_local, self.sin_local = _param(cos, "rope_cos_local"), _param(sin, "rope_sin_local")
        self.embed_scale = spec.embed_scale  # a constant: 1 (no op) but for Gemma
        self.eps = spec.rms_eps
        self.matmul_t = ops.MatMul(transpose_b=True)

    def run_stack(self, x, cos, sin, write_idx, lengths, tables, row_table, positions, local):
        """Every layer in one op (self.stack); arguments as LlamaLayer.fused's, then the rows'
        positions (the local layers' RoPE) and `local`: the local layers' write rows and block tables
        where they have a cache of their own (GraphInputs._local), else empty."""
        if self.local_rope:
            cos_local = ops.expand_dims(ops.gather(self.cos_local, positions, 0), 1)
            sin_local = ops.expand_dims(ops.gather(self.sin_local, positions, 0), 1)
        else:
            cos_local, sin_local = cos, sin
        write_local, tables_local = (local[0], local[1]) if local else (write_idx, tables)
        paging = (tables, row_table, self.layers[0].block_size)
        return self.stack(
            x,
            cos,
            sin,
            write_idx,
            lengths,
            self.layers[0].eps_tensor,
            *paging,
            cos_local,
            sin_local,
            write_local,
            tables_local,
            *self.stack_inputs,
        )

    def embed_tokens(self, tokens, positions):
        if self.kept:
            x = self.kernel_rows(tokens, self.embed, self.embed_format)
        else:
            x = ops.gather(self.embed, tokens, 0)
        if self.embed_scale != 1.0:
            x = x * self.embed_scale
        cos = ops.expand_dims(ops.gather(self.cos, positions, 0), 1)  # [N, 1, hd]
        sin = ops.expand_dims(ops.gather(self.sin, positions, 0), 1)
        return x, cos, sin

    def logits(self, x):
        """Float32 logits whatever the model's dtype: the post-process graphs and the host expect them."""
        x = rms_norm(x, self.final_norm, self.eps, self.dtype, self.half, self.kernel_norm, self.eps_tensor)
        if self.half:
            return ops.cast(self.matmul_t(x, self.lm_head), ms.float32)
        if not self.kept:
            return self.matmul_t(x, self.lm_head)
        logits = self.kernel_matmul_format(x, self.lm_head, self.lm_head_format)
        vocab = self.spec.vocab_size
        return logits if vocab % MATMUL_TILE == 0 else logits[:, :vocab]

    def cache_bytes(self) -> int:
        return 2 * sum(layer.k_cache.size for layer in self.layers) * (2 if self.half else 4)
