"""The CPU the kernels run on, named the way a performance table needs it: its model, its class of
vector instructions (AVX-512, AVX2, Arm NEON with or without dot products) and what the kernels'
target makes of it (MS_LLM_KERNEL_TARGET: a lower target runs AVX2 code on an AVX-512 CPU). The
agent logs it at start and the benchmark writes it beside its tables, so every number says which
machine class made it.

    describe("native", target_macros("native"))
    # "AMD EPYC (x86_64; AVX-512 VNNI); kernels: native (AVX-512 VNNI)"
"""

from __future__ import annotations

import functools
import platform
from pathlib import Path

# /proc/cpuinfo's flag names -> the vector class they make, best first
X86_CLASSES = (
    ("AVX-512 VNNI", ("avx512f", "avx512bw", "avx512_vnni")),
    ("AVX-512", ("avx512f", "avx512bw")),
    ("AVX2", ("avx2", "fma")),
)
ARM_CLASSES = (
    ("NEON dotprod i8mm", ("asimddp", "i8mm")),
    ("NEON dotprod", ("asimddp",)),
    ("NEON", ("asimd",)),
)
# the kernels' macros (agent/kernels/__init__.py KERNEL_MACROS) -> the class of code they compile
MACRO_CLASSES = (
    ("AVX-512 VNNI", ("__AVX512F__", "__AVX512BW__", "__AVX512VNNI__")),
    ("AVX-512", ("__AVX512F__", "__AVX512BW__")),
    ("AVX2", ("__AVX2__", "__FMA__")),
    ("NEON dotprod i8mm", ("__ARM_FEATURE_DOTPROD", "__ARM_FEATURE_MATMUL_INT8")),
    ("NEON dotprod", ("__ARM_FEATURE_DOTPROD",)),
    ("NEON", ("__ARM_NEON",)),
)


@functools.cache
def cpuinfo() -> dict[str, str]:
    """The first processor's fields of /proc/cpuinfo (empty where there is none)."""
    fields: dict[str, str] = {}
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return fields
    for line in text.splitlines():
        if not line.strip():
            if fields:
                break
            continue
        name, _, value = line.partition(":")
        fields.setdefault(name.strip(), value.strip())
    return fields


def flags() -> set[str]:
    """The instruction sets this CPU lists (x86 'flags', Arm 'Features')."""
    info = cpuinfo()
    return set((info.get("flags") or info.get("Features") or platform.processor()).split())


def model() -> str:
    """The CPU's model name (Arm: its implementer and part, where /proc/cpuinfo names no model)."""
    info = cpuinfo()
    name = info.get("model name") or info.get("Model")
    if name:
        return name
    if "CPU implementer" in info:
        return f"Arm CPU implementer {info['CPU implementer']} part {info.get('CPU part', '?')}"
    return platform.processor() or "unknown CPU"


def vector_class(have: set[str] | None = None) -> str:
    """The best class of vector instructions the CPU has."""
    have = flags() if have is None else have
    classes = X86_CLASSES if platform.machine() in ("x86_64", "AMD64") else ARM_CLASSES
    return next((name for name, need in classes if set(need) <= have), "no vector extension")


def code_class(macros: frozenset[str]) -> str:
    """The class of code the kernels compile with these predefined macros."""
    return next((name for name, need in MACRO_CLASSES if set(need) <= macros), "portable")


def describe(target: str, macros: frozenset[str]) -> str:
    """The CPU and what the kernels run on it at `target`, whose compiler defines `macros`."""
    return f"{model()} ({platform.machine()}; {vector_class()}); kernels: {target} ({code_class(macros)})"
