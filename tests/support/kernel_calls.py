"""Calls a custom CPU kernel (agent/kernels) straight through its C entry point with ctypes, the way
MindSpore's AOT custom op does: parameter pointers, their ranks and shapes, the output last; and the
float32 matrices' packing the kernels read. An entry point of the kernels built for Arm and run under
qemu (arm_kernels.py) is called with the arrays themselves."""

import ctypes

import numpy as np


def call(function, arrays: list[np.ndarray], out: np.ndarray) -> int:
    if hasattr(function, "call_arrays"):  # arm_kernels.ArmEntry: in a process under qemu
        return function.call_arrays(arrays, out)
    params = (ctypes.c_void_p * (len(arrays) + 1))(*[a.ctypes.data for a in arrays], out.ctypes.data)
    ndims = (ctypes.c_int * (len(arrays) + 1))(*[a.ndim for a in arrays], out.ndim)
    shapes = [(ctypes.c_int64 * a.ndim)(*a.shape) for a in [*arrays, out]]
    shape_ptrs = (ctypes.POINTER(ctypes.c_int64) * len(shapes))(
        *[ctypes.cast(s, ctypes.POINTER(ctypes.c_int64)) for s in shapes]
    )
    return function(len(arrays) + 1, params, ndims, shape_ptrs, None, None, None)


TILE = 32  # the kernels' column tile (agent/kernels/packed_matmul.h)


def packed(w: np.ndarray) -> np.ndarray:
    """[K, N] -> [N / TILE, K, TILE] (agent/graphs/layers.py pack_for_kernel; N a multiple of TILE)."""
    k, n = w.shape
    return np.ascontiguousarray(w.reshape(k, n // TILE, TILE).transpose(1, 0, 2))
