"""Calls a custom CPU kernel (agent/kernels) straight through its C entry point with ctypes, the way
MindSpore's AOT custom op does: parameter pointers, their ranks and shapes, the output last."""

import ctypes

import numpy as np


def call(function, arrays: list[np.ndarray], out: np.ndarray) -> int:
    params = (ctypes.c_void_p * (len(arrays) + 1))(*[a.ctypes.data for a in arrays], out.ctypes.data)
    ndims = (ctypes.c_int * (len(arrays) + 1))(*[a.ndim for a in arrays], out.ndim)
    shapes = [(ctypes.c_int64 * a.ndim)(*a.shape) for a in [*arrays, out]]
    shape_ptrs = (ctypes.POINTER(ctypes.c_int64) * len(shapes))(
        *[ctypes.cast(s, ctypes.POINTER(ctypes.c_int64)) for s in shapes]
    )
    return function(len(arrays) + 1, params, ndims, shape_ptrs, None, None, None)
