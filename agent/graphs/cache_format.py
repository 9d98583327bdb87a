"""How the KV cache holds one position of one KV head (a cache row), per runtime.kv_cache_dtype: in
the model's dtype (head_dim values), or q8_0: head_dim / 32 blocks of llama.cpp's Q8_0 (a half scale
and 32 int8 quants, 34 bytes for 32 values: the GGUF encoding of the float row), which the fused CPU
layer kernel quantizes as it writes and dequantizes as it attends (agent/kernels/kv_rows.h). Every
reader of the cache's bytes (the memory plan, PD transfer, the KV tiers) sizes rows from here."""

from __future__ import annotations

from dataclasses import dataclass

import gguf
import numpy as np

from config.runtime import RuntimeSection

Q8_0_BLOCK, Q8_0_BYTES = 32, 34
VALUE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


@dataclass(frozen=True)
class CacheFormat:
    name: str  # "q8_0", else the model's dtype: "float32", "float16" or "bfloat16"

    @classmethod
    def of(cls, runtime: RuntimeSection) -> CacheFormat:
        return cls("q8_0" if runtime.kv_cache_dtype == "q8_0" else runtime.dtype)

    @property
    def quantized(self) -> bool:
        return self.name == "q8_0"

    @property
    def numpy_dtype(self) -> type:
        """The element type of the cache's arrays (and of the K/V that PD transfer and the tiers move);
        a bfloat16 cache is moved as float32, NumPy having no bfloat16."""
        return {"q8_0": np.uint8, "float16": np.float16}.get(self.name, np.float32)

    @property
    def mindspore_dtype(self):
        import mindspore as ms  # here alone: the planners and tools that size rows run without MindSpore

        return ms.uint8 if self.quantized else getattr(ms, self.name)

    def row_width(self, head_dim: int) -> int:
        """The elements of one cache row: head_dim values, or a q8_0 row's bytes."""
        if not self.quantized:
            return head_dim
        if head_dim % Q8_0_BLOCK:
            raise ValueError(
                f"runtime.kv_cache_dtype q8_0 quantizes blocks of {Q8_0_BLOCK} values of a head: this "
                f"model's head dim {head_dim} is not a multiple of {Q8_0_BLOCK}; leave kv_cache_dtype auto"
            )
        return head_dim // Q8_0_BLOCK * Q8_0_BYTES

    def row_bytes(self, head_dim: int) -> int:
        return self.row_width(head_dim) if self.quantized else head_dim * VALUE_BYTES[self.name]


def quantize_rows(rows: np.ndarray) -> np.ndarray:
    """Float rows [..., head_dim] -> their q8_0 cache rows [..., row width] (gguf's Q8_0, which the
    kernel's bytes equal: tests/unit/agent/test_kv_cache_q8.py)."""
    return gguf.quants.quantize(np.asarray(rows, np.float32), gguf.GGMLQuantizationType.Q8_0)


def dequantize_rows(rows: np.ndarray) -> np.ndarray:
    """q8_0 cache rows [..., row width] -> the float32 values attention reads."""
    return np.asarray(gguf.quants.dequantize(rows, gguf.GGMLQuantizationType.Q8_0), np.float32)
