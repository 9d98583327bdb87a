"""A layer's mixture-of-experts FFN (Qwen3-MoE's: agent/model/families/qwen3moe.py; Qwen3.5-MoE's with
its shared expert: qwen35moe.py) in the graphs:
its router and experts as Parameters and one op, MoeFfn (agent/kernels/moe.cc), that norms, routes
and runs only the experts each row chooses, rows grouped by expert (one product per used expert);
MoeFfnI8 where the layers run int8 activations (runtime.activations int8: CpuKernels.int8_activations),
its integer-format experts' products then taking int8 inputs as the dense layers' do.

Routing is data-dependent, which a compiled graph's static shapes do not express: the op takes all of
a layer's experts stacked [E, ...] in their file's format (a GGUF's blocks, float32 tiles otherwise)
and reads the chosen ones' weights only. The layer's attention runs in the fused layer kernel with a
zero FFN of one tile (its output: attention + residual), or op by op, then this op adds the experts'
sum. A tensor-parallel rank holds every expert's share of FFN columns (agent/model/shard.py), the
router whole; the decoder sums the ranks' parts as a dense FFN's.

Where MindSpore's products run the layers (Ascend; matmul: mindspore elsewhere), the experts run in
the MoE kernels Ascend has (AscendExperts) or their reference in standard ops (MindSporeExperts)."""

from __future__ import annotations

import dataclasses

import mindspore as ms
import numpy as np
from mindspore import Parameter, Tensor, nn, ops
from mindspore.ops.auto_generate import (
    GroupedMatmulV4,
    MoeGatingTopKSoftmax,
    MoeInitRoutingV2,
    MoeTokenUnpermute,
)

from agent.graphs.layers import MATMUL_TILE, kept_param, param, rms_norm
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
        # the shared expert (Qwen3.5-MoE's) in its own formats, its gate a float32 vector
        self.shared = spec.shared_expert_intermediate_size > 0
        if self.shared:
            if spec.shared_expert_intermediate_size != spec.expert_intermediate_size:
                raise ValueError(
                    f"{spec.architecture}: a shared expert of {spec.shared_expert_intermediate_size} FFN "
                    f"columns beside routed experts of {spec.expert_intermediate_size}: MoeFfn runs it as "
                    "one more expert of theirs, so the two sizes must be equal"
                )
            gate = checkpoint.matrix(p + "shared_expert_gate").reshape(-1)
            self.shared_gate = param(gate, p + "shared_expert_gate")
            for name in EXPERT_MATRICES:
                weights, format_id = kept_param(
                    checkpoint, f"{p}shared_expert.{name}", f"{p}shared_expert.{name}"
                )
                setattr(self, f"shared_{name}", weights)
                ids.append(int(format_id.asnumpy()[0]))
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
        routed = (self.eps_tensor, self.ffn_norm, self.router, self.w_gate, self.w_up, self.w_down)
        if self.shared:
            shared = (self.shared_gate, self.shared_w_gate, self.shared_w_up, self.shared_w_down)
            return self.op(x, lengths, *routed, self.formats, self.options, *shared)
        return self.op(x, lengths, *routed, self.formats, self.options)


class MindSporeExperts(nn.Cell):
    """One layer's routed FFN in standard MindSpore ops, with the inputs of Ascend's MoE kernels (as
    vllm-mindspore's FusedExperts calls them): x + sum over the row's top-k experts of weight *
    expert(norm(x)). The router is float, every expert's gate and up stacked [E, D, 2F] (w1) and its
    down [E, F, D] (w2), in the model's dtype. This reference computes every expert for every row and
    keeps the chosen ones' (E times the work: the semantics and the CPU check, not a fast path);
    AscendExperts runs only the chosen rows through each expert."""

    def __init__(self, checkpoint: Checkpoint, index: int, eps: float, dtype):
        super().__init__()
        spec, p = checkpoint.spec, f"layers.{index}."
        if spec.shared_expert_intermediate_size:
            raise ValueError(
                f"{spec.architecture}: a shared expert runs in the CPU kernels' MoeFfn only "
                "(runtime.matmul: kernel, float32)"
            )
        self.experts, self.top_k, self.renormalize = (
            spec.num_experts,
            spec.experts_per_token,
            spec.norm_topk_prob,
        )
        self.eps, self.dtype, self.half = eps, dtype, dtype != ms.float32
        self.ffn_norm = param(checkpoint.tensors[p + "ffn_norm"], p + "moe_ffn_norm")
        self.router = param(checkpoint.matrix(p + "router"), p + "router", dtype)  # [E, D]

        def expert(e: int, name: str) -> np.ndarray:
            return checkpoint.matrix(f"{p}experts.{e}.{name}")

        w1 = [np.concatenate([expert(e, "w_gate"), expert(e, "w_up")]).T for e in range(self.experts)]
        self.w1 = param(np.stack(w1), p + "experts.w1", dtype)  # [E, D, 2F]
        self.w2 = param(
            np.stack([expert(e, "w_down").T for e in range(self.experts)]), p + "experts.w2", dtype
        )
        self.ffn = self.w2.shape[1]
        self.matmul_t = ops.MatMul(transpose_b=True)
        self.bmm = ops.BatchMatMul()

    def construct(self, x, rows):
        """x [N, D] after attention; rows [N] (unread: every row routed, a padding row's output unread)."""
        h = rms_norm(x, self.ffn_norm, self.eps, self.dtype, self.half, None, None)
        logits = ops.cast(self.matmul_t(h, self.router), ms.float32)  # [N, E]
        weights, ids = self.route(logits)
        return x + self.routed(h, weights, ids)

    def route(self, logits):
        """The top-k experts of each row and their weights (the softmax's, renormalized over the k
        where the model says so)."""
        weights, ids = ops.topk(ops.softmax(logits, -1), self.top_k)
        if self.renormalize:
            weights = weights / (ops.sum(weights, -1, True) + 1e-20)
        return weights, ops.cast(ids, ms.int32)

    def routed(self, h, weights, ids):
        every = ops.broadcast_to(ops.expand_dims(h, 0), (self.experts, -1, -1))  # [E, N, D]
        gate, up = ops.split(self.bmm(every, self.w1), self.ffn, -1)
        out = self.bmm(ops.silu(gate) * up, self.w2)  # [E, N, D]
        chosen = ops.reduce_sum(ops.one_hot(ids, self.experts, 1.0, 0.0) * ops.expand_dims(weights, -1), 1)
        chosen = ops.expand_dims(ops.cast(chosen, self.dtype), 1)  # [N, 1, E]
        return ops.squeeze(self.bmm(chosen, ops.transpose(out, (1, 0, 2))), 1)


class AscendExperts(MindSporeExperts):
    """The same routed FFN on Ascend's MoE kernels, as vllm-mindspore's FusedExperts runs tensor
    parallelism: MoeGatingTopKSoftmax, MoeInitRoutingV2 (rows grouped by expert), GroupedMatmulV4 for
    w1 and w2, MoeTokenUnpermute (each row's experts weighted and summed). Never run: no NPU here."""

    def __init__(self, checkpoint: Checkpoint, index: int, eps: float, dtype):
        super().__init__(checkpoint, index, eps, dtype)
        self.gating = MoeGatingTopKSoftmax()
        self.init_routing = MoeInitRoutingV2()
        self.grouped_matmul = GroupedMatmulV4()
        self.unpermute = MoeTokenUnpermute()

    def route(self, logits):
        weights, ids, _ = self.gating(logits, None, self.top_k)
        if self.renormalize:
            weights = weights / (ops.sum(weights, -1, True) + 1e-20)
        return weights, ops.cast(ids, ms.int32)

    def routed(self, h, weights, ids):
        grouped, unsort, group_list, _ = self.init_routing(h, ids, 0, 0, self.experts, 0, 2, True)
        group_list = ops.cast(group_list, ms.int64)
        gate, up = ops.split(self._per_expert(grouped, self.w1, group_list), self.ffn, -1)
        out = self._per_expert(ops.silu(gate) * up, self.w2, group_list)
        return self.unpermute(out, unsort, ops.cast(weights, self.dtype), False, None)

    def _per_expert(self, rows, weight, group_list):
        """Each expert's rows (grouped, counts in group_list) times its matrix."""
        none = (None,) * 6  # bias, scale, offset, antiquant scale and offset, per-token scale
        return self.grouped_matmul(
            [rows], [weight], *none, group_list, split_item=3, group_type=0, group_list_type=1
        )[0]


def mindspore_experts(device_target: str) -> type[MindSporeExperts]:
    """The routed FFN where MindSpore's ops run the layer: Ascend's kernels there, the reference elsewhere."""
    return AscendExperts if device_target == "Ascend" else MindSporeExperts
