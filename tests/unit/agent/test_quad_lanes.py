"""packed::quad (agent/kernels/lanes.h): four bytes of a column a lane, the int8 products' operand
layout, has one implementation per instruction set (AVX-512 with and without VBMI, AVX2, the
portable shifts). Each is compiled where this CPU runs it and checked against the bytes it reads;
the kernel targets (test_weight_formats) exercise only the one their flags pick."""

import subprocess

import pytest

from agent.kernels import SOURCE_DIR, _compiler, host_cpu

CHECK = r"""
#include "lanes.h"
#include <cstdio>
int main() {
  alignas(64) uint8_t tile[8 * packed::TILE];
  for (int i = 0; i < 8 * packed::TILE; ++i) tile[i] = static_cast<uint8_t>(i * 37 + 11);
  int wrong = 0;
  for (int u = 0; u < 5; ++u)
    for (int c = 0; c < packed::VECTORS; ++c) {
      const uint8_t *p = tile + u * packed::TILE + c * packed::LANES;
      const packed::vi got = packed::quad(p);
      for (int t = 0; t < packed::LANES; ++t) {
        uint32_t want = 0;
        for (int e = 0; e < 4; ++e) want |= static_cast<uint32_t>(p[e * packed::TILE + t]) << (8 * e);
        wrong += static_cast<uint32_t>(got[t]) != want;
      }
    }
  std::printf("%d lanes, %d wrong\n", packed::LANES, wrong);
  return wrong != 0;
}
"""

# (flags, what /proc/cpuinfo must list to run them)
VARIANTS = [
    (["-march=native"], ()),
    (["-march=native", "-mno-avx512vbmi"], ("avx512f", "avx512bw")),
    (["-march=x86-64-v3"], ("avx2", "fma", "f16c", "bmi2")),
    (["-march=x86-64"], ("sse2",)),
]


@pytest.mark.parametrize("flags,needs", VARIANTS, ids=lambda v: " ".join(v) if isinstance(v, list) else "")
def test_every_implementation_of_quad_reads_the_same_bytes(tmp_path, flags, needs):
    cpu = host_cpu.flags()
    if not all(flag in cpu for flag in needs):
        pytest.skip(f"this CPU cannot run {' '.join(flags)}")
    source, program = tmp_path / "check.cc", tmp_path / "check"
    source.write_text(CHECK)
    build = [_compiler(), "-O2", "-std=c++17", "-Wno-psabi", *flags, f"-I{SOURCE_DIR}"]
    subprocess.run([*build, "-o", str(program), str(source)], check=True)
    result = subprocess.run([str(program)], capture_output=True, text=True)
    assert result.returncode == 0 and "0 wrong" in result.stdout, result.stdout
