"""The CPU named as a performance table needs it (agent/kernels/host_cpu.py): its vector class from
/proc/cpuinfo's flags, and what the kernels' target compiles on it."""

import platform

import pytest

from agent.kernels import host_cpu, target_macros

X86 = platform.machine() in ("x86_64", "AMD64")


@pytest.mark.skipif(not X86, reason="x86 flag names")
@pytest.mark.parametrize(
    "flags, named",
    [
        ({"avx2", "fma", "avx512f", "avx512bw", "avx512_vnni"}, "AVX-512 VNNI"),
        ({"avx2", "fma", "avx512f", "avx512bw"}, "AVX-512"),
        ({"avx2", "fma"}, "AVX2"),  # a Zen 3, most users' machines
        ({"sse2"}, "no vector extension"),
    ],
)
def test_the_vector_class_is_the_best_the_flags_make(flags, named):
    assert host_cpu.vector_class(flags) == named


def test_the_kernels_code_class_follows_the_target_not_the_cpu():
    """MS_LLM_KERNEL_TARGET=avx2 on an AVX-512 CPU runs AVX2 code: the table must say AVX2."""
    assert host_cpu.code_class(frozenset({"__AVX2__", "__FMA__", "__AVX512F__"})) == "AVX2"
    assert host_cpu.code_class(frozenset({"__ARM_NEON", "__ARM_FEATURE_DOTPROD"})) == "NEON dotprod"
    assert host_cpu.code_class(frozenset()) == "portable"
    described = host_cpu.describe("portable", target_macros("portable"))
    assert described.startswith(host_cpu.model()) and described.endswith("kernels: portable (portable)")
