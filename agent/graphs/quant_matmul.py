"""A linear of an int8 checkpoint (agent/model/formats/int8_checkpoint.py) with the contract of Ascend's
quantized products, one cell a product: `x [N, K] -> [N, out]` in the model's dtype, its weights int8
[out, K] as the file holds them and its scales from the checkpoint's Int8Linear (agent/model/quantized.py):

- static (msModelSlim W8A8): xq = clamp(round(x * (1 / input_scale) + input_offset), -128, 127) (QuantV2,
  the reciprocal as vllm-ascend passes it), y = (xq @ q^T + quant_bias) * deq_scale (QuantBatchMatmul);
- dynamic (per-token int8 activations): xq, t = DynamicQuantExt(x) with t = max |x_row| / 127,
  y = (xq @ q^T) * weight_scale * t (QuantBatchMatmul's per-token scale);
- weight_only: y = x @ (q * weight_scale)^T (WeightQuantBatchMatmul).

Int8Matmul computes exactly that in standard MindSpore ops (integer products in int32, rounding half to
even), on every target, and is tested on CPU against numpy (tests/integration/agent/test_w8a8_models.py).
AscendInt8Matmul calls the Ascend kernels with the same inputs; this project has no NPU, so it has never
run, and two of its inputs' forms are read from CANN's documentation, not tried: deq_scale for a float16
output as int64 holding the float32's bits (msModelSlim's file form; float32 for bfloat16), and
WeightQuantBatchMatmul's per-channel antiquant_scale as [out, 1] for a transposed weight.

A static linear's quant_bias holds its bias (Q/K/V's too): a layer running it adds no bias of its own.
Linears that share an input run as one product (`Int8Matmul.of`, rows concatenated) only where their
activation quantization is the same (input_scale and input_offset), else each alone.
"""

from __future__ import annotations

import mindspore as ms
import numpy as np
from mindspore import Parameter, Tensor, nn, ops
from mindspore.ops.auto_generate import DynamicQuantExt, QuantBatchMatmul, QuantV2, WeightQuantBatchMatmul

from agent.model.checkpoint import Checkpoint
from agent.model.quantized import Int8Linear

INT8_MIN, INT8_MAX = -128.0, 127.0


def _param(array: np.ndarray, name: str, dtype=None) -> Parameter:
    return Parameter(Tensor(np.ascontiguousarray(array), dtype=dtype), name=name, requires_grad=False)


def joined(
    linears: list[Int8Linear], weights: list[np.ndarray], output_scales: list[float] | None = None
) -> tuple[Int8Linear, np.ndarray]:
    """Linears sharing an input as one (their rows in turn), each one's outputs times its output scale
    (the attention scale folded into Q's rows: its dequantization scales times it, the int8 weights
    as they are); a ValueError where their schemes or static activation quantization differ."""
    first = linears[0]
    for linear in linears[1:]:
        same = (linear.scheme, linear.input_scale, linear.input_offset) == (
            first.scheme,
            first.input_scale,
            first.input_offset,
        )
        if not same:
            raise ValueError("int8 linears of different activation quantization cannot share one product")
    factors = [np.float32(f) for f in output_scales or [1.0] * len(linears)]
    static = first.scheme == "static"
    linear = Int8Linear(
        scheme=first.scheme,
        weight_scale=np.concatenate([lin.weight_scale * f for lin, f in zip(linears, factors)]),
        deq_scale=np.concatenate([_given(lin.deq_scale) * f for lin, f in zip(linears, factors)])
        if static
        else None,
        quant_bias=np.concatenate([_given(lin.quant_bias) for lin in linears]) if static else None,
        input_scale=first.input_scale,
        input_offset=first.input_offset,
    )
    return linear, np.concatenate(weights)


def _given(values: np.ndarray | None) -> np.ndarray:
    """A static linear's deq_scale or quant_bias, which its scheme always has."""
    assert values is not None, "a static int8 linear without its dequantization"
    return values


class Int8Matmul(nn.Cell):
    """y = x @ W^T of an int8 linear (module docstring), in standard ops."""

    def __init__(self, linear: Int8Linear, weight: np.ndarray, name: str, dtype=ms.float16):
        """weight: int8 [out, K] (Checkpoint.int8_weight); dtype: x's and y's."""
        super().__init__()
        self.scheme, self.dtype = linear.scheme, dtype
        out, k = weight.shape
        self.weight = _param(weight.astype(np.int8), name)
        self.weight_scale = _param(linear.weight_scale.astype(np.float32), f"{name}_weight_scale")
        if self.scheme == "static":
            # QuantV2 takes the scale and offset at x's last axis
            self.input_scale_reciprocal = _param(
                np.full(k, 1.0 / linear.input_scale, np.float32), f"{name}_x_scale", dtype
            )
            self.input_offset = _param(np.full(k, linear.input_offset, np.float32), f"{name}_x_offset", dtype)
            self.deq_scale = _param(np.asarray(linear.deq_scale, np.float32), f"{name}_deq_scale")
            self.quant_bias = _param(np.asarray(linear.quant_bias, np.int32), f"{name}_quant_bias")
        self.matmul_t = ops.MatMul(transpose_b=True)

    @classmethod
    def of(
        cls,
        checkpoint: Checkpoint,
        names: list[str],
        param_name: str,
        dtype=ms.float16,
        output_scales: list[float] | None = None,
    ) -> Int8Matmul:
        """The cell of a checkpoint's int8 linears (canonical names) sharing an input, as one product
        (`joined`: output_scales, one a linear)."""
        linears = [checkpoint.int8[n] for n in names]
        linear, weight = joined(linears, [checkpoint.int8_weight(n) for n in names], output_scales)
        return cls(linear, weight, param_name, dtype)

    def construct(self, x):
        x = ops.cast(x, ms.float32)
        if self.scheme == "weight_only":
            w = ops.cast(self.weight, ms.float32) * ops.expand_dims(self.weight_scale, 1)
            return ops.cast(self.matmul_t(x, w), self.dtype)
        if self.scheme == "static":
            scaled = x * ops.cast(self.input_scale_reciprocal, ms.float32) + ops.cast(
                self.input_offset, ms.float32
            )
            xq = ops.clip_by_value(ops.round(scaled), INT8_MIN, INT8_MAX)
            acc = self._int_product(xq) + self.quant_bias
            return ops.cast(ops.cast(acc, ms.float32) * self.deq_scale, self.dtype)
        row_max = ops.amax(ops.abs(x), -1, True)
        # a zero row (a step's padding) takes scale 1: its products stay 0 instead of NaN
        token_scale = ops.select(row_max > 0, row_max / INT8_MAX, ops.ones_like(row_max))
        acc = self._int_product(ops.round(x / token_scale))
        return ops.cast(ops.cast(acc, ms.float32) * self.weight_scale * token_scale, self.dtype)

    def _int_product(self, xq):
        """Exact integer sums (int32 holds 127 x 128 x K for K < 2^17)."""
        return ops.matmul(ops.cast(xq, ms.int32), ops.transpose(ops.cast(self.weight, ms.int32), (1, 0)))


class AscendInt8Matmul(Int8Matmul):
    """The same product on Ascend's kernels (module docstring). Never run: no NPU here."""

    def __init__(self, linear: Int8Linear, weight: np.ndarray, name: str, dtype=ms.float16):
        super().__init__(linear, weight, name, dtype)
        self.quant = QuantV2()
        self.dynamic_quant = DynamicQuantExt()
        self.quant_matmul = QuantBatchMatmul(transpose_x1=False, transpose_x2=True, dtype=dtype)
        self.weight_quant_matmul = WeightQuantBatchMatmul(transpose_x=False, transpose_weight=True)
        if self.scheme == "static" and dtype == ms.float16:
            # the float16 kernel's scale: the float32's bits, as int64 (msModelSlim's file form)
            bits = np.asarray(linear.deq_scale, np.float32).view(np.uint32).astype(np.int64)
            self.deq_scale_op = _param(bits, f"{name}_deq_scale_bits")
        elif self.scheme == "static":
            self.deq_scale_op = self.deq_scale
        if self.scheme == "weight_only":
            scale = linear.weight_scale.astype(np.float32).reshape(-1, 1)
            self.antiquant_scale = _param(scale, f"{name}_antiquant_scale", dtype)

    def construct(self, x):
        if self.scheme == "weight_only":
            return self.weight_quant_matmul(x, self.weight, self.antiquant_scale)
        if self.scheme == "static":
            xq = self.quant(x, self.input_scale_reciprocal, self.input_offset)
            return self.quant_matmul(xq, self.weight, self.deq_scale_op, None, self.quant_bias)
        xq, token_scale = self.dynamic_quant(x)
        return self.quant_matmul(xq, self.weight, self.weight_scale, None, None, token_scale)


def int8_matmul_cell(device_target: str) -> type[Int8Matmul]:
    """The cell a device runs an int8 linear with: Ascend's kernels there, the reference elsewhere."""
    return AscendInt8Matmul if device_target == "Ascend" else Int8Matmul
