"""Custom CPU kernels used inside MindSpore graphs (AOT custom operators), built from source with the
machine's C++ compiler: at `make setup`, or on first use when the build is missing or older than its
source. `python -m agent.kernels` builds them and says where.
"""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

SOURCE_DIR = Path(__file__).parent
BUILD_DIR = SOURCE_DIR / "build"
DECODE_ATTENTION = "decode_attention"
SKINNY_MATMUL = "skinny_matmul"
ELEMENTWISE = "elementwise"
FUSED_LAYER = "fused_layer"
KERNELS = (DECODE_ATTENTION, SKINNY_MATMUL, ELEMENTWISE, FUSED_LAYER)
# -fopenmp: they split their work over OpenMP threads (and vectorise `omp simd` loops).
FLAGS = ["-O3", "-march=native", "-shared", "-fPIC", "-std=c++17", "-fopenmp"]
HEADERS = tuple(sorted(SOURCE_DIR.glob("*.h")))


class KernelBuildError(RuntimeError):
    """The kernel could not be compiled; the message holds the compiler's output."""


def source(name: str) -> Path:
    return SOURCE_DIR / f"{name}.cc"


def build(name: str) -> Path:
    """The kernel's shared library, compiled now if missing or stale."""
    src, lib = source(name), BUILD_DIR / f"{name}.so"
    newest = max(path.stat().st_mtime for path in (src, *HEADERS))
    if lib.is_file() and lib.stat().st_mtime >= newest:
        return lib
    compiler = shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        raise KernelBuildError(f"no C++ compiler (g++) to build {src.name}; install g++ (Debian: "
                               "apt-get install g++) or set runtime.decode_attention: gather")
    BUILD_DIR.mkdir(exist_ok=True)
    tmp = lib.with_suffix(".so.tmp")
    done = subprocess.run([compiler, *FLAGS, "-o", str(tmp), str(src)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        raise KernelBuildError(f"building {src.name} failed:\n{done.stderr.strip()}")
    tmp.replace(lib)  # atomic: concurrent agents never load a half-written library
    return lib


def op_path(kernel: str, function: str) -> str:
    """The `path:function` MindSpore's ops.Custom(func_type="aot") loads (the kernel built if needed)."""
    return f"{build(kernel)}:{function}"
