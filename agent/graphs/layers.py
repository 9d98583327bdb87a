"""The layer math and weight handling every family's decoder shares (agent/graphs/decoder.py): RMSNorm,
the RoPE tables (a model's own, and the sliding-window layers' of a base of their own), the packed
weights of the CPU kernels, the custom CPU ops, and a tensor-parallel rank's share of the heads and
FFN columns. A family's layer differences are spec fields (agent/model/families/), each a variant
computed here or in the decoder once for every family that has it.

Tensor parallelism (TensorSplit, LayerShare: agent/model/shard.py): each rank of a group holds a
contiguous run of KV heads with their query heads (Q/K/V rows, the matching columns of wo, its own KV
cache) and of FFN columns (gate/up rows, down columns; in a MoE layer every expert's, the router
whole); an AllReduce inside the graph sums the partial outputs of wo and w_down (or of the experts).
The embedding, norms and lm_head are whole on every rank, so every rank computes the same logits.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import dataclasses

import mindspore as ms
import numpy as np
from mindspore import Parameter, Tensor, ops
from mindspore.common.initializer import Zero

from agent.kernels import op_path
from agent.model.checkpoint import Checkpoint
from agent.model.quantized import BlockMatrix
from agent.model.shard import WHOLE_MODEL as WHOLE_MODEL  # re-exported: the graphs import them here
from agent.model.shard import LayerShare as LayerShare
from agent.model.shard import TensorSplit as TensorSplit
from agent.model.spec import ModelSpec

MATMUL_TILE = 32  # columns per packed tile of agent/kernels/skinny_matmul.cc


def fused_only_features(spec: ModelSpec) -> list[str]:
    """The layer features of a model that only the fused kernel computes (Gemma 3's): none for a
    Llama-shaped layer, Qwen3's (QK-norm) or Qwen3-MoE's (the experts' op follows either path)."""
    features = {
        "post-norms": spec.post_norms,
        "GeGLU": spec.activation != "silu",
        "sliding-window layers": bool(spec.local_layers and spec.sliding_window),
        "scaled embeddings": spec.embed_scale != 1.0,
        "NoPE layers": bool(spec.nope_layers),
        "Gated DeltaNet layers": spec.linear_attention is not None,
        "gated attention": spec.output_gate,
        "partial RoPE": spec.rope_dims != spec.head_dim,
        "bidirectional attention": spec.bidirectional,
    }
    return [name for name, present in features.items() if present]


def rope_tables(
    spec: ModelSpec, max_len: int, kind: str = "global"
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """cos and signed sin tables [max_len, rope_dims] and the rotate-half matrix R, so that
    rope(x) = x * cos + (x @ R) * sin, with x @ R = concat(x2, x1) and the sign folded into sin;
    `kind` (ModelSpec.rope): the model's frequencies, the sliding-window layers', or none (NoPE
    layers: cos 1, sin 0, x as it is). With partial RoPE (Qwen3.5's) the tables cover the rotated
    dims only: the fused kernel leaves the rest of each head as it is."""
    hd = spec.rope_dims
    inv_freq = np.zeros(hd // 2) if kind == "none" else spec.rope_inv_freq(kind == "local")
    angles = np.outer(np.arange(max_len, dtype=np.float64), inv_freq)  # [max_len, hd/2]
    cos = np.concatenate([np.cos(angles)] * 2, axis=1)
    sin = np.concatenate([-np.sin(angles), np.sin(angles)], axis=1)
    half = hd // 2
    rot = np.zeros((hd, hd), np.float32)
    rot[np.arange(half) + half, np.arange(half)] = 1.0  # out[:half] = x[half:]
    rot[np.arange(half), np.arange(half) + half] = 1.0  # out[half:] = x[:half]
    return cos.astype(np.float32), sin.astype(np.float32), rot


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


def param(array: np.ndarray, name: str, dtype=ms.float32) -> Parameter:
    # a rank's share held in float16 (agent/model/checkpoint.py take_share) goes in without a float32 copy
    held = np.float16 if array.dtype == np.float16 else np.float32
    return Parameter(
        Tensor(np.ascontiguousarray(array, dtype=held), dtype=dtype), name=name, requires_grad=False
    )


def zeros(shape: tuple[int, ...], name: str, dtype) -> Parameter:
    """A Parameter of zeros that MindSpore allocates itself: the KV cache, GBs that a numpy array
    copied twice into (3.5 GB: 6.5 s of an agent's start); its pages are touched as the cache fills."""
    zeroed = Parameter(Tensor(shape=shape, dtype=dtype, init=Zero()), name=name, requires_grad=False)
    zeroed.init_data()
    return zeroed


def kept_param(checkpoint: Checkpoint, name: str, param_name: str) -> tuple[Parameter, Parameter]:
    """A matrix packed for the kernels' products (product.h) as a Parameter (uint8, or float32 for a
    float matrix) and its format id as an int32 [1] Parameter. A matrix the checkpoint keeps in its
    format is then held once: the checkpoint's entry becomes a view of the Parameter's memory."""
    kept = checkpoint.blocks.get(name)
    matrix = kept if kept is not None else BlockMatrix.from_float(checkpoint.tensors[name])
    weights = Parameter(Tensor(matrix.packed), name=param_name, requires_grad=False)
    if kept is not None:
        checkpoint.blocks[name] = dataclasses.replace(kept, packed=weights.asnumpy())
    return weights, Parameter(Tensor(np.array([matrix.qtype], np.int32)), name=f"{param_name}_format")


def pack_for_kernel(w: np.ndarray) -> np.ndarray:
    """[K, N] -> [ceil(N / TILE), K, TILE], zero columns padding N: each tile one contiguous stream."""
    k, n = w.shape
    tiles = -(-n // MATMUL_TILE)
    padded = np.zeros((k, tiles * MATMUL_TILE), np.float32)
    padded[:, :n] = w
    return padded.reshape(k, tiles, MATMUL_TILE).transpose(1, 0, 2)


def release_freed_memory() -> None:
    """Give the pages of freed heap memory back to the system (glibc's malloc_trim). The loader's
    packed matrices are copied into Parameters and freed; glibc had served the later, weight-sized
    ones from its heap (its mmap threshold rises with each large free), whose holes it keeps: 530 MB
    of a 7B model's resident memory."""
    libc = ctypes.util.find_library("c")
    if libc is not None and hasattr(ctypes.CDLL(libc), "malloc_trim"):
        ctypes.CDLL(libc).malloc_trim(0)


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
        self.int8_activations = int8_activations  # the MoE layers' op too (agent/graphs/moe.py)
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
