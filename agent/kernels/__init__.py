"""Custom CPU kernels used inside MindSpore graphs (AOT custom operators), built from source with the
machine's C++ compiler: at `make setup`, or on first use when the build is missing.
`python -m agent.kernels` builds them and says where.

Builds are content-addressed: build/<build_id>/ where build_id hashes everything that changes the
machine code (sources, headers, flags, the compiler's version, the CPU's instruction sets that
-march=native picks from), so a changed input never loads an old library (an mtime check does not
hold across copies, checkouts with preserved times, compiler upgrades or another machine's folder).
"""

from __future__ import annotations

import functools
import hashlib
import os
import platform
import shutil
import subprocess
from pathlib import Path

SOURCE_DIR = Path(__file__).parent
BUILD_ROOT = SOURCE_DIR / "build"
KERNELS = ("decode_attention", "skinny_matmul", "elementwise", "fused_layer")
# One library for all: its thread team (thread_team.h) is one per process, whichever op calls it.
LIBRARY = "kernels"
# -fopenmp-simd: `omp simd` loops are vectorised; the threads are thread_team.h's, not OpenMP's.
FLAGS = ["-O3", "-march=native", "-shared", "-fPIC", "-std=c++17", "-fopenmp-simd", "-pthread"]
HEADERS = tuple(sorted(SOURCE_DIR.glob("*.h")))


class KernelBuildError(RuntimeError):
    """The kernel could not be compiled; the message holds the compiler's output."""


def source(name: str) -> Path:
    return SOURCE_DIR / f"{name}.cc"


def _compiler() -> str:
    compiler = shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        raise KernelBuildError(
            "no C++ compiler (g++) to build the CPU kernels; install g++ (Debian: "
            "apt-get install g++) or set runtime.decode_attention: gather"
        )
    return compiler


def _cpu_flags() -> str:
    """The instruction sets -march=native chooses from (x86 'flags', Arm 'Features')."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()


@functools.cache
def build_id() -> str:
    """The identity of the kernels' machine code on this machine (see the module docstring)."""
    compiler = shutil.which("g++") or shutil.which("c++")
    version = (
        subprocess.run([compiler, "--version"], capture_output=True, text=True).stdout if compiler else ""
    )
    digest = hashlib.sha256()
    for part in (" ".join(FLAGS), version, platform.machine(), _cpu_flags()):
        digest.update(part.encode() + b"\0")
    for path in (*(source(name) for name in KERNELS), *HEADERS):
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:16]


def build_dir() -> Path:
    return BUILD_ROOT / build_id()


def build() -> Path:
    """The kernels' shared library of this build_id, compiled now if missing."""
    lib = build_dir() / f"{LIBRARY}.so"
    if lib.is_file():
        return lib
    lib.parent.mkdir(parents=True, exist_ok=True)
    tmp = lib.with_suffix(f".so.tmp{os.getpid()}")
    sources = [str(source(name)) for name in KERNELS]
    done = subprocess.run([_compiler(), *FLAGS, "-o", str(tmp), *sources], capture_output=True, text=True)
    if done.returncode != 0:
        tmp.unlink(missing_ok=True)
        raise KernelBuildError(f"building {LIBRARY}.so failed:\n{done.stderr.strip()}")
    tmp.replace(lib)  # atomic: concurrent agents never load a half-written library
    return lib


# Calls of more rows than this take the int8 products under runtime.activations int8 (packed_matmul.h
# q4i8::ABOVE_ROWS).
INT8_ABOVE_ROWS = 4


def has_int8_products() -> bool:
    """The CPU has what the opt-in int8 products (packed_matmul.h q4i8) are built with: AVX512-VNNI
    (and AVX512BW). Without it the library's int8 ops refuse every call."""
    flags = _cpu_flags().split()
    return "avx512_vnni" in flags and "avx512bw" in flags


def op_path(function: str) -> str:
    """The `path:function` MindSpore's ops.Custom(func_type="aot") loads (the library built if needed)."""
    return f"{build()}:{function}"
