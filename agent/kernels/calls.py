"""The kernels' products called from Python through ctypes, outside any graph: the known answer's
numpy forward (agent/known_answer.py) multiplies the matrices a checkpoint keeps in their format this
way instead of dequantizing the whole model with numpy (seconds for a 1B model; this: milliseconds).
The entry points are the graphs' own (MindSpore's AOT custom-op calling convention)."""

from __future__ import annotations

import ctypes
import functools

import numpy as np

from agent.kernels import build
from agent.model.quantized import TILE, BlockMatrix


@functools.cache
def _library() -> ctypes.CDLL:
    return ctypes.CDLL(str(build()))


def _call(function: str, arrays: list[np.ndarray], out: np.ndarray) -> None:
    arrays = [*arrays, out]
    params = (ctypes.c_void_p * len(arrays))(*[a.ctypes.data for a in arrays])
    ndims = (ctypes.c_int * len(arrays))(*[a.ndim for a in arrays])
    shapes = [(ctypes.c_int64 * a.ndim)(*a.shape) for a in arrays]
    pointers = (ctypes.POINTER(ctypes.c_int64) * len(shapes))(
        *[ctypes.cast(s, ctypes.POINTER(ctypes.c_int64)) for s in shapes]
    )
    if getattr(_library(), function)(len(arrays), params, ndims, pointers, None, None, None) != 0:
        raise ValueError(f"the kernel {function} refused its inputs")


def product(x: np.ndarray, matrix: BlockMatrix) -> np.ndarray:
    """x [M, cols] @ matrix.T -> [M, rows] float32."""
    x = np.ascontiguousarray(x, np.float32)
    out = np.empty((len(x), matrix.packed.shape[0] * TILE), np.float32)
    _call("SkinnyMatMulFormat", [x, matrix.packed, np.array([matrix.qtype], np.int32)], out)
    return out[:, : matrix.shape[0]]


def rows(matrix: BlockMatrix, ids: np.ndarray) -> np.ndarray:
    """The matrix's rows `ids` as float32 [len(ids), cols]."""
    out = np.empty((len(ids), matrix.shape[1]), np.float32)
    _call("MatrixRows", [np.asarray(ids, np.int32), matrix.packed, np.array([matrix.qtype], np.int32)], out)
    return out
