"""Tiny int8 checkpoints written by the tests: a float HuggingFace directory
(tiny_models.write_tiny_checkpoint) with its layers' linears quantized to int8 per output row, as
msModelSlim's W8A8 export (Ascend's: quant_model_description.json, deq_scale, quant_bias,
input_scale, input_offset) or llm-compressor's compressed-tensors int8; and beside it the float
directory of what the files dequantize to, for the numpy reference: msModelSlim's
W = q * deq_scale / input_scale and b = (quant_bias + input_offset sum_k q) * deq_scale (vllm-ascend's
y = (xq @ q^T + quant_bias) * deq_scale with xq = x / input_scale + input_offset), compressed-tensors'
W = q * weight_scale. Written with numpy alone (no agent code)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file, save_file

LINEARS = (
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
)
# a power of two: deq_scale = input_scale x weight_scale is then exact in float32, and so is its quotient
EXACT_INPUT_SCALE = 2.0**-5
INPUT_OFFSET = 3
COMPRESSED_CONFIG = {
    "quant_method": "compressed-tensors",
    "format": "int-quantized",
    "quantization_status": "compressed",
    "ignore": ["lm_head"],
    "kv_cache_scheme": None,
    "config_groups": {
        "group_0": {
            "targets": ["Linear"],
            "weights": {
                "num_bits": 8,
                "type": "int",
                "symmetric": True,
                "strategy": "channel",
                "dynamic": False,
            },
            "input_activations": {
                "num_bits": 8,
                "type": "int",
                "symmetric": True,
                "strategy": "token",
                "dynamic": True,
            },
        }
    },
}


def quantize_rows(w: np.ndarray, exact_scales: bool) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric int8 a row: (q int8, scale float32) with w ~ q * scale. exact_scales: each scale a
    float16 value (a Q8_0 block's scale holds it exactly)."""
    scale = (np.abs(w).max(axis=1) / 127).astype(np.float32)
    if exact_scales:
        scale = scale.astype(np.float16).astype(np.float32)
    q = np.clip(np.rint(w / scale[:, None]), -127, 127).astype(np.int8)
    return q, scale


def _is_linear(name: str) -> bool:
    return (
        name.startswith("model.layers.")
        and name.removesuffix(".weight").endswith(LINEARS)
        and name.endswith(".weight")
    )


def _copy_config(float_dir: Path, out: Path, config_update: dict | None = None) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for file in float_dir.iterdir():
        if file.suffix == ".json" and file.name != "model.safetensors.index.json":
            shutil.copy(file, out / file.name)
    if config_update:
        config = json.loads((out / "config.json").read_text())
        config.update(config_update)
        (out / "config.json").write_text(json.dumps(config))


def write_modelslim(
    float_dir: Path,
    out: Path,
    *,
    quant_type: str = "W8A8",
    deq_scale_dtype: str = "int64",
    exact_scales: bool = True,
    input_scale: float = EXACT_INPUT_SCALE,
    input_offset: int = INPUT_OFFSET,
    float_down_proj: bool = False,
) -> tuple[Path, Path]:
    """msModelSlim's export of float_dir's weights in `out`/w8a8 and what it dequantizes to in
    `out`/dequantized. quant_type W8A8: deq_scale_dtype "int64" (float32 bits sign-extended: a float16
    model's export) or "float32" (a bfloat16 model's); a float bias (Qwen2's Q/K/V) goes into
    quant_bias, rounded, and stays in the file as FLOAT too (msModelSlim's optional copy; the NPU's
    product adds quant_bias's); input_scale is stored as float16, as a float16 model's export holds
    it. W8A8_DYNAMIC and W8A16: weight, weight_scale and weight_offset (0) alone, the bias float.
    float_down_proj: the layers' down_proj left FLOAT, as msModelSlim's fallback of sensitive layers
    leaves some."""
    raw = load_file(str(next(float_dir.glob("*.safetensors"))))
    static = quant_type == "W8A8"
    stored_input_scale = np.array([input_scale], np.float16)
    s_in = float(stored_input_scale[0])
    tensors: dict[str, np.ndarray] = {}
    dequantized: dict[str, np.ndarray] = {}
    description: dict[str, str] = {"model_quant_type": quant_type}
    for name, w in raw.items():
        prefix = name.removesuffix("weight")
        quantized = _is_linear(name) and not (float_down_proj and "down_proj" in name)
        if not quantized:
            tensors[name] = w
            if not (static and name.endswith(".bias") and _is_linear(prefix + "weight")):
                dequantized[name] = w  # else quant_bias's, below
            description[name] = "FLOAT"
            continue
        q, w_scale = quantize_rows(w, exact_scales)
        parts = {
            name: q,
            prefix + "weight_scale": w_scale[:, None],
            prefix + "weight_offset": np.zeros((len(q), 1), np.float32),
        }
        dequantized[name] = (q * w_scale.astype(np.float64)[:, None]).astype(np.float32)
        if static:
            deq = (np.float32(s_in) * w_scale).astype(np.float32)
            row_sums = q.sum(axis=1, dtype=np.int64)
            bias = raw.get(prefix + "bias")
            quant_bias = -input_offset * row_sums
            if bias is not None:
                quant_bias = quant_bias + np.rint(bias / deq).astype(np.int64)
            quant_bias = quant_bias.astype(np.int32)
            bits = deq.view(np.int32).astype(np.int64)  # msModelSlim's int64 form: the int32 view, widened
            parts |= {
                prefix + "deq_scale": bits if deq_scale_dtype == "int64" else deq,
                prefix + "quant_bias": quant_bias,
                prefix + "input_scale": stored_input_scale,
                prefix + "input_offset": np.array([input_offset], np.float16),
            }
            f64 = deq.astype(np.float64)
            dequantized[name] = (q * (f64 / s_in)[:, None]).astype(np.float32)
            if bias is not None:
                dequantized[prefix + "bias"] = ((quant_bias + input_offset * row_sums) * f64).astype(
                    np.float32
                )
        tensors |= parts
        description |= dict.fromkeys(parts, quant_type)
    int8_dir, float_out = out / "w8a8", out / "dequantized"
    _copy_config(float_dir, int8_dir)
    save_file(tensors, str(int8_dir / "quant_model_weight_w8a8.safetensors"))
    (int8_dir / "quant_model_description.json").write_text(json.dumps(description, indent=1))
    _copy_config(float_dir, float_out)
    save_file(dequantized, str(float_out / "model.safetensors"))
    return int8_dir, float_out


def write_compressed_int8(
    float_dir: Path, out: Path, *, exact_scales: bool = True, config: dict | None = None
) -> tuple[Path, Path]:
    """compressed-tensors int8 (weights per channel, activations dynamic per token: llm-compressor's W8A8
    scheme) of float_dir's weights in `out`/int8, the LM head left float as its ignore list says, and
    what it dequantizes to in `out`/dequantized. config: the quantization_config (COMPRESSED_CONFIG)."""
    raw = load_file(str(next(float_dir.glob("*.safetensors"))))
    tensors: dict[str, np.ndarray] = {}
    dequantized: dict[str, np.ndarray] = {}
    for name, w in raw.items():
        if not _is_linear(name):
            tensors[name] = dequantized[name] = w
            continue
        q, scale = quantize_rows(w, exact_scales)
        tensors[name], tensors[name.removesuffix("weight") + "weight_scale"] = q, scale[:, None]
        dequantized[name] = (q * scale.astype(np.float64)[:, None]).astype(np.float32)
    int8_dir, float_out = out / "int8", out / "dequantized"
    _copy_config(float_dir, int8_dir, {"quantization_config": config or COMPRESSED_CONFIG})
    save_file(tensors, str(int8_dir / "model.safetensors"))
    _copy_config(float_dir, float_out)
    save_file(dequantized, str(float_out / "model.safetensors"))
    return int8_dir, float_out
