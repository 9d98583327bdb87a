"""Int8 checkpoints in Hugging Face directories, read beside the float tensors by
agent/model/formats/hf_dir.py: msModelSlim's (the W8A8 checkpoints Ascend users deploy,
quant_model_description.json naming each tensor's type) and llm-compressor's compressed-tensors int8
(config.json's quantization_config). Each linear holds int8 weights q [out, in] and one float scale
an output row; what a linear computes:

- msModelSlim W8A8 (activations quantized per tensor with a calibrated scale and offset), as Ascend's
  QuantBatchMatmul computes it (vllm-ascend's AscendW8A8LinearMethod):
      xq = clamp(round(x / input_scale + input_offset), -128, 127)
      y  = (xq @ q^T + quant_bias) * deq_scale
  deq_scale per output row: float32, or int64 holding a float32's bits in its low 32 (the form the
  float16 op takes); input_offset an int8 value. With xq ~ x / input_scale + input_offset (the
  activations' rounding and clipping left out), y = x @ W^T + b where
      W = q * (deq_scale / input_scale)              (per output row)
      b = (quant_bias + input_offset * sum_k q) * deq_scale
  quant_bias cancels the offset's term and carries the float bias (divided by deq_scale, rounded), so b
  is the layer's bias: Q/K/V's where the model has one. Elsewhere it must be only the rounding of
  msModelSlim's correction (|quant_bias + input_offset * sum_k q| <= 1 + 2^-23 |input_offset * sum_k q|),
  or the checkpoint is refused. weight_scale and weight_offset, if present, are not read: the NPU's
  product does not use them.
- msModelSlim W8A8_DYNAMIC (activations quantized per token as they come) and W8A16 (weights only),
  compressed-tensors int8 (activations per token or float): W = q * weight_scale; weight_offset or
  weight_zero_point must be 0 (symmetric).

On CPU W is multiplied by the kernels as Q8_0 blocks (agent/model/quantized.py BlockMatrix.from_int8):
the int8 values as they are and each block's float16 scale the row's scale rounded to float16 (2^-11
relative at most; none for a bfloat16 scale, which float16 holds exactly). The activations stay float32
(or, with runtime.activations int8, rounded per block of 32 as for any integer format), not rounded
to a static per-tensor scale: the CPU computes W8A8's weights with more precise activations than the
NPU. A matrix whose rows are not whole blocks or whose scales leave float16's normal range is kept in
float32, saying so. The scales and biases stay in Checkpoint.int8 for Ascend's quantized products
(agent/graphs/quant_matmul.py). Anything else (other types, asymmetric or per-group weights, 4 bits,
msModelSlim's anti-outlier norm biases) is refused, naming what is supported.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from agent.model.checkpoint import Checkpoint, CheckpointError
from agent.model.quantized import F16_NORMAL, Q8_0_BLOCK, BlockMatrix, Int8Linear

log = logging.getLogger(__name__)

Readers = Mapping[str, Callable[[], np.ndarray]]  # file tensor name -> its array, read when called
MODELSLIM_SCHEMES = {"W8A8": "static", "W8A8_DYNAMIC": "dynamic", "W8A16": "weight_only"}
MODELSLIM_SUPPORTED = (
    "supported: W8A8, W8A8_DYNAMIC and W8A16 with symmetric int8 weights per output channel, and FLOAT"
)
COMPRESSED_FORMATS = ("int-quantized", "naive-quantized")
COMPRESSED_SUPPORTED = (
    "supported: format int-quantized or naive-quantized; weights num_bits 8, type int, symmetric, "
    "strategy channel or tensor; input_activations none, or num_bits 8, type int, symmetric, dynamic, "
    "strategy token"
)
BIAS_OF = {"wq": "bq", "wk": "bk", "wv": "bv"}  # the canonical matrices a layer may have a bias for
DESCRIPTION_GLOB = "quant_model_description*.json"


@dataclass(frozen=True)
class Int8Weights:
    """One linear as its files hold it: int8 values, scales, and (msModelSlim W8A8) the bias its
    quant_bias carries, with whether that bias is only the rounding of the offset's correction."""

    quants: np.ndarray  # int8 [out, in]
    linear: Int8Linear
    bias: np.ndarray | None = None  # float32 [out]
    bias_is_rounding: bool = True


class ModelSlim:
    """msModelSlim's export: quant_model_description.json names each tensor's type ("W8A8", "FLOAT", ...)."""

    def __init__(self, path: Path, description: dict):
        self.path, self.kinds = path, description

    def linears(self, tensors: Readers) -> dict[str, str]:
        """The quantized linears by their weight's name, each with its scheme (Int8Linear): the weights
        with scales beside them (a description may give a smoothed norm's weight its layer's type)."""
        for name in tensors:
            if name.endswith("norm.bias") or ".module." in name:
                raise CheckpointError(
                    f"{self.path}: {name} is msModelSlim's anti-outlier norm parameter, which is not "
                    "supported (export without anti-outlier suppression, or with one that leaves the "
                    "norms without bias)"
                )
        schemes = {}
        for name in tensors:
            prefix = name.removesuffix("weight")
            scaled = prefix + "deq_scale" in tensors or prefix + "weight_scale" in tensors
            if not name.endswith(".weight") or not scaled:
                continue
            kind = self.kinds.get(name, "FLOAT")
            if kind == "FLOAT":
                continue
            if kind not in MODELSLIM_SCHEMES:
                raise CheckpointError(
                    f"{self.path}: {name} is {kind}, which is not supported ({MODELSLIM_SUPPORTED})"
                )
            schemes[name] = MODELSLIM_SCHEMES[kind]
        return schemes

    def parameters(self, weight: str) -> list[str]:
        prefix = weight.removesuffix("weight")
        names = ("deq_scale", "quant_bias", "input_scale", "input_offset", "weight_scale", "weight_offset")
        return [prefix + n for n in names]

    def read(self, weight: str, scheme: str, tensors: Readers) -> Int8Weights:
        prefix = weight.removesuffix("weight")
        quants = _int8(self.path, weight, tensors[weight]())
        if scheme != "static":
            scale = _row_scales(self.path, prefix, quants, tensors, "weight_offset")
            return Int8Weights(quants, Int8Linear(scheme=scheme, weight_scale=scale))
        for part in ("deq_scale", "input_scale", "input_offset"):
            if prefix + part not in tensors:
                raise CheckpointError(f"{self.path}: W8A8 {weight} has no {prefix + part}")
        deq_scale = _deq_scale(tensors[prefix + "deq_scale"]())
        input_scale = _one(self.path, prefix + "input_scale", tensors)
        input_offset = _one(self.path, prefix + "input_offset", tensors)
        if input_offset != round(input_offset) or not -128 <= input_offset <= 127:
            raise CheckpointError(f"{self.path}: {prefix}input_offset {input_offset} is not an int8 value")
        rows = len(quants)
        if deq_scale.shape != (rows,) or not np.isfinite(deq_scale).all() or not input_scale > 0:
            raise CheckpointError(
                f"{self.path}: {prefix}deq_scale must be {rows} finite values and input_scale positive"
            )
        quant_bias = np.zeros(rows, np.int32)
        if prefix + "quant_bias" in tensors:
            quant_bias = np.asarray(tensors[prefix + "quant_bias"](), np.int32).reshape(rows)
        # exact in int64: what quant_bias adds beyond cancelling the offset's term
        correction = int(input_offset) * quants.sum(axis=1, dtype=np.int64)
        residual = quant_bias.astype(np.int64) + correction
        linear = Int8Linear(
            scheme="static",
            weight_scale=(deq_scale / np.float32(input_scale)).astype(np.float32),
            deq_scale=deq_scale,
            quant_bias=quant_bias,
            input_scale=input_scale,
            input_offset=input_offset,
        )
        rounding = bool((np.abs(residual) <= 1 + np.abs(correction) * 2.0**-23).all())
        bias = (residual * deq_scale.astype(np.float64)).astype(np.float32)
        return Int8Weights(quants, linear, bias, rounding)


class CompressedTensors:
    """llm-compressor's int8 export: quantization_config in config.json (quant_method
    compressed-tensors), each quantized linear's X.weight int8 and X.weight_scale [out, 1]."""

    def __init__(self, path: Path, scheme: str):
        self.path, self.scheme = path, scheme

    @classmethod
    def of(cls, path: Path, quantization: dict) -> CompressedTensors:
        """The one scheme every config group describes; a CheckpointError for any other."""

        def refuse(what: str) -> CheckpointError:
            return CheckpointError(
                f"{path}: compressed-tensors {what} is not supported ({COMPRESSED_SUPPORTED})"
            )

        groups = quantization.get("config_groups") or {}
        if not isinstance(groups, dict) or not groups:
            raise refuse("quantization_config without config_groups")
        schemes = {cls._group_scheme(name, group, quantization, refuse) for name, group in groups.items()}
        if len(schemes) > 1:
            raise refuse("config_groups of different activation schemes")
        if quantization.get("kv_cache_scheme"):
            log.info("%s: kv_cache_scheme ignored: the KV cache holds the model's own dtype", path)
        return cls(path, schemes.pop())

    @staticmethod
    def _group_scheme(group_name: str, group: dict, quantization: dict, refuse) -> str:
        """A config group's activation scheme, "weight_only" or "dynamic" (int8 per token); a
        refusal for weights other than symmetric int8 per channel or tensor, or other activations."""
        fmt = group.get("format") or quantization.get("format")
        if fmt not in COMPRESSED_FORMATS:
            raise refuse(f"format {fmt!r}")
        weights = group.get("weights") or {}
        bits, kind, strategy = weights.get("num_bits"), weights.get("type"), weights.get("strategy")
        if bits != 8 or kind != "int":
            raise refuse(f"{group_name} weights of {bits} bits, type {kind!r},")
        if weights.get("symmetric") is not True:
            raise refuse(f"{group_name} asymmetric weights")
        if strategy not in ("channel", "tensor"):
            raise refuse(f"{group_name} weights of strategy {strategy!r}")
        activations = group.get("input_activations")
        if activations is None:
            return "weight_only"
        dynamic_token = activations.get("dynamic") is True and activations.get("strategy") == "token"
        if activations.get("num_bits") != 8 or activations.get("type") != "int" or not dynamic_token:
            raise refuse(
                f"{group_name} input_activations ({activations.get('num_bits')} bits, type "
                f"{activations.get('type')!r}, dynamic {activations.get('dynamic')}, strategy "
                f"{activations.get('strategy')!r})"
            )
        if activations.get("symmetric") is not True:
            raise refuse(f"{group_name} asymmetric input_activations")
        return "dynamic"

    def linears(self, tensors: Readers) -> dict[str, str]:
        """Every weight with a weight_scale beside it (those the config's ignore list left out have none)."""
        return {
            name: self.scheme
            for name in tensors
            if name.endswith(".weight") and name.removesuffix("weight") + "weight_scale" in tensors
        }

    def parameters(self, weight: str) -> list[str]:
        prefix = weight.removesuffix("weight")
        return [prefix + n for n in ("weight_scale", "weight_zero_point", "input_scale", "input_zero_point")]

    def read(self, weight: str, scheme: str, tensors: Readers) -> Int8Weights:
        quants = _int8(self.path, weight, tensors[weight]())
        scale = _row_scales(self.path, weight.removesuffix("weight"), quants, tensors, "weight_zero_point")
        return Int8Weights(quants, Int8Linear(scheme=scheme, weight_scale=scale))


Int8Format = ModelSlim | CompressedTensors


def find_format(directory: Path, config: dict) -> Int8Format | None:
    """The directory's int8 format, None for a float checkpoint; a CheckpointError naming what is
    supported for any other quantization."""
    descriptions = sorted(directory.glob(DESCRIPTION_GLOB))
    if len(descriptions) > 1:
        raise CheckpointError(
            f"{directory}: several msModelSlim descriptions: {[p.name for p in descriptions]}"
        )
    if descriptions:
        try:
            description = json.loads(descriptions[0].read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise CheckpointError(f"cannot read {descriptions[0]}: {exc}") from exc
        if not isinstance(description, dict):
            raise CheckpointError(f"{descriptions[0]}: not a JSON object of tensor names and types")
        return ModelSlim(descriptions[0], description)
    quantization = config.get("quantization_config")
    if quantization is None:
        return None
    method = quantization.get("quant_method") if isinstance(quantization, dict) else None
    if method == "compressed-tensors":
        return CompressedTensors.of(directory / "config.json", quantization)
    raise CheckpointError(
        f"{directory / 'config.json'}: quantization_config quant_method {method!r} is not supported "
        "(supported: compressed-tensors int8, and msModelSlim's W8A8 with its quant_model_description.json)"
    )


def read_linears(fmt: Int8Format, tensors: dict[str, Callable[[], np.ndarray]]) -> dict[str, Int8Weights]:
    """Each int8 linear by its weight's file name; its tensors are taken out of `tensors`, which keeps
    the float ones."""
    linears = {}
    for weight, scheme in fmt.linears(tensors).items():
        linears[weight] = fmt.read(weight, scheme, tensors)
        for name in [weight, *fmt.parameters(weight)]:
            tensors.pop(name, None)
    return linears


def place(
    linears: dict[str, Int8Weights],
    checkpoint: Checkpoint,
    tensors: dict[str, np.ndarray],
    canonical: Callable[[str], str | None],
) -> None:
    """Each linear into the checkpoint (its float `tensors`, the dict it was built over) under its
    canonical name: the matrix as Q8_0 blocks (float32
    where the kernels cannot take its rows or float16 its scales), its Int8Linear, and its bias where
    the layer has a place for one (Q/K/V with a QKV bias), which then replaces any float bias read."""
    spec = checkpoint.spec
    for weight, int8 in linears.items():
        name = canonical(weight)
        if name is None:
            log.debug("ignoring int8 tensor %s", weight)
            continue
        scale = int8.linear.weight_scale
        cols = int8.quants.shape[1]
        magnitude = np.abs(scale)
        in_range = (magnitude == 0) | ((magnitude >= F16_NORMAL[0]) & (magnitude <= F16_NORMAL[1]))
        if cols % Q8_0_BLOCK == 0 and in_range.all():
            checkpoint.blocks[name] = BlockMatrix.from_int8(int8.quants, scale)
        else:
            why = (
                f"rows of {cols} weights are not whole blocks of {Q8_0_BLOCK}"
                if cols % Q8_0_BLOCK
                else f"scales {magnitude.min():.3g} to {magnitude.max():.3g} leave float16's normal range"
            )
            log.warning(
                "%s: int8 %s kept as float32 (%s): the Q8_0 kernels cannot take it",
                checkpoint.source,
                weight,
                why,
            )
            tensors[name] = int8.quants * scale[:, None].astype(np.float32)
        checkpoint.int8[name] = int8.linear
        if int8.bias is None:
            continue
        short = name.rpartition(".")[2]
        if spec.qkv_bias and short in BIAS_OF:
            tensors[name.removesuffix(short) + BIAS_OF[short]] = int8.bias
        elif not int8.bias_is_rounding:
            raise CheckpointError(
                f"{checkpoint.source}: {weight.removesuffix('weight')}quant_bias carries a bias beyond "
                f"the input offset's correction (up to {np.abs(int8.bias).max():.3g}), which a "
                f"{spec.architecture} {short} has no place for"
            )


def _int8(path: Path, name: str, weights: np.ndarray) -> np.ndarray:
    if weights.dtype != np.int8 or weights.ndim != 2:
        raise CheckpointError(
            f"{path}: {name} is {weights.dtype} {list(weights.shape)}, expected int8 [out, in]"
        )
    return weights


def _row_scales(
    path: Path, prefix: str, quants: np.ndarray, tensors: Readers, offset_name: str
) -> np.ndarray:
    """weight_scale as one float32 a row ([out], [out, 1], or one for the whole matrix); its offset
    (zero point) must be 0 throughout."""
    rows = len(quants)
    if prefix + "weight_scale" not in tensors:
        raise CheckpointError(f"{path}: {prefix}weight has no {prefix}weight_scale")
    scale = np.asarray(tensors[prefix + "weight_scale"](), np.float32)
    if scale.ndim == 2 and scale.shape[1] > 1:
        raise CheckpointError(
            f"{path}: {prefix}weight_scale {list(scale.shape)} is per group of "
            f"{quants.shape[1] // scale.shape[1]} weights: only one scale an output channel is supported"
        )
    if scale.size not in (1, rows):
        raise CheckpointError(f"{path}: {prefix}weight_scale {list(scale.shape)} does not match {rows} rows")
    if prefix + offset_name in tensors and np.any(tensors[prefix + offset_name]() != 0):
        raise CheckpointError(
            f"{path}: {prefix}{offset_name} is not 0: asymmetric int8 weights are not supported "
            "(symmetric only)"
        )
    return np.ascontiguousarray(np.broadcast_to(scale.reshape(-1), (rows,)))


def _deq_scale(raw: np.ndarray) -> np.ndarray:
    """deq_scale as float32: an int64 one holds a float32's bits in its low 32 (msModelSlim's form for
    the float16 op, the int32 view of the float sign-extended)."""
    raw = np.asarray(raw).reshape(-1)
    if raw.dtype.kind in "iu":
        return (raw.astype(np.int64) & 0xFFFFFFFF).astype(np.uint32).view(np.float32)
    return raw.astype(np.float32)


def _one(path: Path, name: str, tensors: Readers) -> float:
    value = np.asarray(tensors[name]()).reshape(-1)
    if len(value) != 1:
        raise CheckpointError(
            f"{path}: {name} has {len(value)} values: only per-tensor activation quantization is supported"
        )
    return float(value[0])
