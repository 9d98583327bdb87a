"""Custom CPU kernels used inside MindSpore graphs (AOT custom operators), built from source with the
machine's C++ compiler: at `make setup`, or on first use when the build is missing.
`python -m agent.kernels` builds them and says where.

Builds are content-addressed: build/<build_id>/ where build_id hashes everything that changes the
machine code (sources, headers, flags, the compiler's version, the CPU's instruction sets that
-march=native picks from), so a changed input never loads an old library (an mtime check does not
hold across copies, checkouts with preserved times, compiler upgrades or another machine's folder).

The target (environment variable MS_LLM_KERNEL_TARGET) is the instruction-set level the kernels are
compiled for: `native` (the default: this CPU's own), `avx2` (x86-64-v3: AVX2 and FMA, no AVX-512,
what most users' x86 machines have) or `portable` (no vector instruction set named: the kernels'
vector-extension fallback as an old x86 CPU compiles it; on an Arm host, plain NEON, armv8-a). A
lower target runs slower; the tests run the kernels at every target this machine can execute, so the
code paths other machines take are built and checked here too; the Arm builds are cross-compiled and
run under qemu (tests/unit/agent/test_arm_kernels.py)."""

from __future__ import annotations

import functools
import hashlib
import os
import platform
import shutil
import subprocess
from pathlib import Path

from agent.kernels import host_cpu

SOURCE_DIR = Path(__file__).parent
BUILD_ROOT = SOURCE_DIR / "build"
KERNELS = ("decode_attention", "skinny_matmul", "elementwise", "fused_layer", "moe")
# One library for all: its thread team (thread_team.h) is one per process, whichever op calls it.
LIBRARY = "kernels"
# -fopenmp-simd: `omp simd` loops are vectorised; the threads are thread_team.h's, not OpenMP's.
# -fvisibility=hidden: only the ops' entry points are exported (entry.h says why).
FLAGS = ["-O3", "-shared", "-fPIC", "-std=c++17", "-fopenmp-simd", "-pthread", "-fvisibility=hidden"]
HEADERS = tuple(sorted(SOURCE_DIR.rglob("*.h")))

TARGET_ENV = "MS_LLM_KERNEL_TARGET"
TARGETS = ("native", "avx2", "portable")
# What an x86-64-v3 CPU has (/proc/cpuinfo's names): the avx2 target runs where all of these do.
AVX2_LEVEL = ("avx", "avx2", "fma", "f16c", "bmi1", "bmi2", "movbe", "abm")
# The predefined macros the kernels choose their code by (#ifdef): two targets that define the
# same ones compile the same code.
KERNEL_MACROS = (
    "__SSE__",
    "__AVX__",
    "__AVX2__",
    "__FMA__",
    "__F16C__",
    "__AVX512F__",
    "__AVX512BW__",
    "__AVX512VNNI__",
    "__ARM_NEON",
    "__aarch64__",
    "__ARM_FEATURE_DOTPROD",
    "__ARM_FEATURE_MATMUL_INT8",
)


class KernelBuildError(RuntimeError):
    """The kernel could not be compiled; the message holds the compiler's output."""


def source(name: str) -> Path:
    return SOURCE_DIR / f"{name}.cc"


def _compiler() -> str:
    compiler = shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        raise KernelBuildError(
            "no C++ compiler (g++) to build the CPU kernels; install g++ (Debian: apt-get install g++), "
            "or set runtime.decode_attention: gather and runtime.matmul: mindspore"
        )
    return compiler


def target() -> str:
    """The target of this process's kernels (MS_LLM_KERNEL_TARGET, default native)."""
    name = os.environ.get(TARGET_ENV, "").strip() or "native"
    if name not in TARGETS:
        raise KernelBuildError(
            f"{TARGET_ENV}={name!r} is not a kernel target; use one of {', '.join(TARGETS)}"
        )
    if name == "avx2" and platform.machine() not in ("x86_64", "AMD64"):
        raise KernelBuildError(f"{TARGET_ENV}=avx2 is an x86-64 target; this machine is {platform.machine()}")
    return name


def target_flags(name: str) -> list[str]:
    """The compiler's flags of a target."""
    if name == "native":
        return ["-march=native"]
    if name == "avx2":
        return ["-march=x86-64-v3"]
    # No vector instruction set beyond the architecture's baseline (SSE2 on x86-64, NEON on AArch64):
    # -Wno-psabi: the 32-byte vector types' ABI note, moot for functions inlined into the library.
    x86 = platform.machine() in ("x86_64", "AMD64")
    return ["-march=x86-64" if x86 else "-march=armv8-a", "-mtune=generic", "-Wno-psabi"]


def can_run(name: str) -> bool:
    """This CPU executes the target's code."""
    if name == "avx2":
        flags = host_cpu.flags()
        return platform.machine() in ("x86_64", "AMD64") and all(flag in flags for flag in AVX2_LEVEL)
    return True


@functools.cache
def target_macros(name: str) -> frozenset[str]:
    """Which of KERNEL_MACROS the compiler defines at this target."""
    done = subprocess.run(
        [_compiler(), *target_flags(name), "-dM", "-E", "-x", "c++", os.devnull],
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        raise KernelBuildError(f"the compiler refused the {name} target:\n{done.stderr.strip()}")
    defined = {line.split()[1] for line in done.stdout.splitlines() if line.startswith("#define ")}
    return frozenset(defined.intersection(KERNEL_MACROS))


def testable_targets() -> list[str]:
    """The targets this machine executes that compile other code than native does (native first)."""
    seen = {target_macros("native")}
    targets = ["native"]
    for name in TARGETS[1:]:
        if can_run(name) and target_macros(name) not in seen:
            seen.add(target_macros(name))
            targets.append(name)
    return targets


@functools.cache
def build_id(name: str | None = None) -> str:
    """The identity of the kernels' machine code at a target (default: this process's) on this
    machine (see the module docstring)."""
    name = name or target()
    compiler = shutil.which("g++") or shutil.which("c++")
    version = (
        subprocess.run([compiler, "--version"], capture_output=True, text=True).stdout if compiler else ""
    )
    digest = hashlib.sha256()
    # Only -march=native depends on this CPU's instruction sets; a lower target's code does not.
    cpu = " ".join(sorted(host_cpu.flags())) if name == "native" else ""
    for part in (" ".join(FLAGS + target_flags(name)), version, platform.machine(), cpu):
        digest.update(part.encode() + b"\0")
    for path in (*(source(kernel) for kernel in KERNELS), *HEADERS):
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:16]


def build_dir(name: str | None = None) -> Path:
    return BUILD_ROOT / build_id(name)


def build(name: str | None = None) -> Path:
    """The kernels' shared library of a target (default: this process's), compiled now if missing:
    each source to an object at once (every weight format's products make skinny_matmul.cc and
    fused_layer.cc some 15 s each), then linked."""
    name = name or target()
    lib = build_dir(name) / f"{LIBRARY}.so"
    if lib.is_file():
        return lib
    lib.parent.mkdir(parents=True, exist_ok=True)
    tmp = lib.with_suffix(f".so.tmp{os.getpid()}")
    objects = [lib.parent / f"{kernel}.o.tmp{os.getpid()}" for kernel in KERNELS]
    compile_flags = [flag for flag in FLAGS if flag != "-shared"]
    jobs = [
        subprocess.Popen(
            [_compiler(), *compile_flags, *target_flags(name), "-c", "-o", str(obj), str(source(kernel))],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for kernel, obj in zip(KERNELS, objects, strict=True)
    ]
    errors = [job.communicate()[1] for job in jobs]
    try:
        if any(job.returncode != 0 for job in jobs):
            raise KernelBuildError(
                f"building {LIBRARY}.so ({name} target) failed:\n" + "\n".join(e.strip() for e in errors if e)
            )
        command = [_compiler(), *FLAGS, *target_flags(name), "-o", str(tmp), *map(str, objects)]
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            tmp.unlink(missing_ok=True)
            raise KernelBuildError(f"linking {LIBRARY}.so ({name} target) failed:\n{done.stderr.strip()}")
    finally:
        for obj in objects:
            obj.unlink(missing_ok=True)
    tmp.replace(lib)  # atomic: concurrent agents never load a half-written library
    return lib


def has_int8_products(name: str | None = None) -> bool:
    """The kernels of a target (default: this process's) hold the opt-in int8 products
    (int8_products.h): built with AVX512-VNNI and AVX512BW, or with AVX2, or for AArch64 (SDOT with
    the dot-product extension, else plain NEON). Without them (the portable x86 target) the library's
    int8 ops refuse every call."""
    macros = target_macros(name or target())
    return (
        {"__AVX512VNNI__", "__AVX512BW__"} <= macros
        or "__AVX2__" in macros
        or {"__aarch64__", "__ARM_NEON"} <= macros
    )


def op_path(function: str) -> str:
    """The `path:function` MindSpore's ops.Custom(func_type="aot") loads (the library built if needed)."""
    return f"{build()}:{function}"
