"""A layer's mixture-of-experts FFN (Qwen3-MoE's: agent/model/families/qwen3moe.py) in the graphs:
its router and experts as Parameters and one op, MoeFfn (agent/kernels/moe.cc), that norms, routes
and runs only the experts each row chooses, rows grouped by expert (one product per used expert);
MoeFfnI8 where the layers run int8 activations (runtime.activations int8: CpuKernels.int8_activations),
its integer-format experts' products then taking int8 inputs as the dense layers' do.

Routing is data-dependent, which a compiled graph's static shapes do not express: the op takes all of
a layer's experts stacked [E, ...] in their file's format (a GGUF's blocks, float32 tiles otherwise)
and reads the chosen ones' weights only. The layer's attention runs in the fused layer kernel with a
zero FFN of one tile (its output: attention + residual), or op by op, then this op adds the experts'
sum. A tensor-parallel rank holds every expert's share of FFN columns (agent/model/shard.py), the
router whole; the decoder sums the ranks' parts as a dense FFN's."""

from __future__ import annotations

import dataclasses

import numpy as np
from mindspore import Parameter, Tensor, nn, ops

from agent.graphs.layers import MATMUL_TILE, param
from agent.kernels import op_path
from agent.model.checkpoint import Checkpoint
from agent.model.quantized import F32, BlockMatrix

EXPERT_MATRICES = ("w_gate", "w_up", "w_down")


def stacked(checkpoint: Checkpoint, prefix: str, name: str, experts: int) -> tuple[np.ndarray, int]:
    """Every expert's matrix `name` packed for the kernels, stacked [E, ...], and their format id:
    their file's where all experts share it, else all float32 tiles."""
    kept = [checkpoint.blocks.get(f"{prefix}experts.{e}.{name}") for e in range(experts)]
    formats = {k.qtype if k is not None else F32 for k in kept}
    if len(formats) > 1 or formats == {F32}:
        kept = [
            BlockMatrix.from_float(checkpoint.matrix(f"{prefix}experts.{e}.{name}")) for e in range(experts)
        ]
    matrices = [k for k in kept if k is not None]
    return np.stack([m.packed for m in matrices]), int(matrices[0].qtype)


def zero_ffn(hidden: int, prefix: str) -> dict[str, Parameter]:
    """The fused layer kernel's FFN matrices for a MoE layer: zeros of one tile (its output is then
    the attention's plus the residual, exactly: x1 + 0)."""
    shapes = {"w_gate": (MATMUL_TILE, hidden), "w_up": (MATMUL_TILE, hidden), "w_down": (hidden, MATMUL_TILE)}
    return {
        name: Parameter(
            Tensor(BlockMatrix.from_float(np.zeros(shape, np.float32)).packed), prefix + name, False
        )
        for name, shape in shapes.items()
    }


class ExpertsFfn(nn.Cell):
    """One layer's routed FFN: x + sum over the row's top-k experts of weight * expert(norm(x))."""

    def __init__(
        self, checkpoint: Checkpoint, index: int, eps_tensor: Tensor, int8_activations: bool = False
    ):
        super().__init__()
        spec, p = checkpoint.spec, f"layers.{index}."
        self.ffn_norm = param(checkpoint.tensors[p + "ffn_norm"], p + "moe_ffn_norm")
        self.eps_tensor = eps_tensor
        router = BlockMatrix.from_float(checkpoint.matrix(p + "router"))
        self.router = Parameter(Tensor(router.packed), name=p + "router", requires_grad=False)
        ids = [int(F32)]
        for name in EXPERT_MATRICES:
            weights, qtype = stacked(checkpoint, p, name, spec.num_experts)
            stack = Parameter(Tensor(weights), name=f"{p}experts.{name}", requires_grad=False)
            setattr(self, name, stack)
            ids.append(qtype)
            # held once: a kept expert's entry becomes a view of the stacked Parameter's memory
            held = stack.asnumpy()
            for e in range(spec.num_experts):
                kept = checkpoint.blocks.get(f"{p}experts.{e}.{name}")
                if kept is not None and kept.qtype == qtype:
                    checkpoint.blocks[f"{p}experts.{e}.{name}"] = dataclasses.replace(kept, packed=held[e])
        self.formats = Parameter(Tensor(np.array(ids, np.int32)), name=p + "moe_formats", requires_grad=False)
        options = [spec.experts_per_token, int(spec.norm_topk_prob)]
        self.options = Parameter(
            Tensor(np.array(options, np.int32)), name=p + "moe_options", requires_grad=False
        )
        self.op = ops.Custom(
            op_path("MoeFfnI8" if int8_activations else "MoeFfn"),
            out_shape=lambda x, *_: x,
            out_dtype=lambda x, *_: x,
            func_type="aot",
        )

    def construct(self, x, lengths):
        """x [N, D] after attention; lengths [N * KV] the fused layer's (0: a padding row, left as it is)."""
        return self.op(
            x,
            lengths,
            self.eps_tensor,
            self.ffn_norm,
            self.router,
            self.w_gate,
            self.w_up,
            self.w_down,
            self.formats,
            self.options,
        )
