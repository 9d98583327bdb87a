"""The kernels built for AArch64 and run under qemu-aarch64 (user mode) on this x86 machine: the CPU
kernels' sources and the call driver tests/support/kernel_cases.cc cross-compiled at one Arm target
(plain NEON, the dot-product extension, i8mm), cached by content in agent/kernels/build/arm-*, and
one driver process a target that executes the calls the x86 tests make through ctypes
(kernel_calls.call takes an `ArmKernels` entry as it takes a ctypes function).

What they need (Debian: g++-aarch64-linux-gnu, qemu-user; `make arm-tools` installs them) is looked
up by `missing_tools`, whose reason a test skips with."""

from __future__ import annotations

import fcntl
import hashlib
import os
import select
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from agent.kernels import BUILD_ROOT, FLAGS, HEADERS, KERNELS, source

COMPILER = "aarch64-linux-gnu-g++"
OBJDUMP = "aarch64-linux-gnu-objdump"
QEMU = "qemu-aarch64"
SYSROOT = Path("/usr/aarch64-linux-gnu")  # the cross toolchain's libc and libstdc++ (qemu -L)
DRIVER = Path(__file__).with_name("kernel_cases.cc")
CALL_TIMEOUT_S = 120.0  # one call under qemu (the largest here take well under a second)


@dataclass(frozen=True)
class ArmTarget:
    """An Arm build: its -march, the kernels' macros it must define and the instructions its int8
    products must (and must not) contain."""

    name: str
    march: str
    macros: frozenset[str]
    instructions: frozenset[str]
    absent: frozenset[str]


TARGETS = (
    ArmTarget(
        "neon",
        "armv8-a",
        frozenset({"__aarch64__", "__ARM_NEON"}),
        frozenset({"smull", "sadalp"}),
        frozenset({"sdot", "smmla"}),
    ),
    ArmTarget(
        "dotprod",
        "armv8.2-a+dotprod",
        frozenset({"__aarch64__", "__ARM_NEON", "__ARM_FEATURE_DOTPROD"}),
        frozenset({"sdot"}),
        frozenset({"smmla", "sadalp"}),
    ),
    ArmTarget(
        "i8mm",
        "armv8.6-a+i8mm+dotprod",
        frozenset({"__aarch64__", "__ARM_NEON", "__ARM_FEATURE_DOTPROD", "__ARM_FEATURE_MATMUL_INT8"}),
        frozenset({"sdot", "smmla"}),
        frozenset({"sadalp"}),
    ),
)


def missing_tools() -> str | None:
    """Why the Arm builds cannot be made and run here, or None."""
    missing = [tool for tool in (COMPILER, OBJDUMP, QEMU) if shutil.which(tool) is None]
    if not (SYSROOT / "lib").is_dir():
        missing.append(f"{SYSROOT}/lib (the AArch64 libc)")
    if missing:
        return (
            f"no {', '.join(missing)}: the Arm kernels are cross-compiled and run under qemu; install "
            "them with `make arm-tools` (as root: apt-get install g++-aarch64-linux-gnu qemu-user)"
        )
    return None


def _run(command: list[str]) -> str:
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed:\n{done.stderr.strip()}")
    return done.stdout


def defined_macros(target: ArmTarget) -> set[str]:
    """The macros the cross compiler predefines at the target."""
    out = _run([COMPILER, f"-march={target.march}", "-dM", "-E", "-x", "c++", os.devnull])
    return {line.split()[1] for line in out.splitlines() if line.startswith("#define ")}


def _flags(target: ArmTarget) -> list[str]:
    return [flag for flag in FLAGS if flag not in ("-shared", "-fPIC")] + [f"-march={target.march}"]


def build(target: ArmTarget) -> Path:
    """The driver linked with the kernels for the target, compiled now if missing (the sources, in
    parallel; some 15 s of CPU each for the large ones). Concurrent test workers wait on a lock and
    take the one build."""
    digest = hashlib.sha256(" ".join([*_flags(target), _run([COMPILER, "--version"])]).encode())
    for path in (*(source(kernel) for kernel in KERNELS), *HEADERS, DRIVER):
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    folder = BUILD_ROOT / f"arm-{target.name}-{digest.hexdigest()[:16]}"
    program = folder / "kernel_cases"
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if program.is_file():
            return program
        sources = [source(kernel) for kernel in KERNELS] + [DRIVER]
        objects = [folder / f"{path.stem}.o" for path in sources]
        jobs = [
            subprocess.Popen(
                [COMPILER, *_flags(target), "-c", "-o", str(obj), str(src)],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for src, obj in zip(sources, objects, strict=True)
        ]
        errors = [job.communicate()[1] for job in jobs]
        if any(job.returncode != 0 for job in jobs):
            raise RuntimeError(f"building the {target.name} kernels failed:\n" + "\n".join(errors))
        tmp = program.with_suffix(f".tmp{os.getpid()}")
        _run([COMPILER, *_flags(target), "-o", str(tmp), *map(str, objects)])
        for obj in objects:
            obj.unlink()
        tmp.replace(program)
    return program


def instruction_counts(program: Path, names: frozenset[str]) -> dict[str, int]:
    """How often each instruction occurs in the program's machine code."""
    counts = dict.fromkeys(names, 0)
    for line in _run([OBJDUMP, "-d", "--no-show-raw-insn", str(program)]).splitlines():
        fields = line.split("\t")
        if len(fields) >= 2 and fields[1].strip() in counts:
            counts[fields[1].strip()] += 1
    return counts


class ArmKernels:
    """A driver process under qemu (-cpu max: every extension the targets use); `kernels.Name` is
    the entry point `Name`, called with numpy arrays as kernel_calls.call calls it."""

    def __init__(self, program: Path) -> None:
        self.program = program
        self._stderr = tempfile.TemporaryFile()
        self._process = subprocess.Popen(
            [QEMU, "-L", str(SYSROOT), "-cpu", "max", str(program)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._stderr,
        )

    def __getattr__(self, name: str) -> ArmEntry:
        if name.startswith("_"):
            raise AttributeError(name)
        return ArmEntry(self, name)

    def call(self, name: str, arrays: list[np.ndarray]) -> int:
        """The entry point's return code; the arrays hold what it wrote into them (the output,
        caches written in place)."""
        assert self._process.stdin is not None
        message = [f"{name} {len(arrays)}\n".encode()]
        for a in arrays:
            assert a.flags.c_contiguous, f"{name}: a non-contiguous array"
            message += [f"{a.ndim} {' '.join(map(str, a.shape))} {a.nbytes}\n".encode(), a.tobytes()]
        try:
            self._process.stdin.write(b"".join(message))
            self._process.stdin.flush()
        except BrokenPipeError:
            raise RuntimeError(f"the Arm kernels under qemu stopped: {self._failure()}") from None
        code = int(self._read_line())
        for a in arrays:
            after = self._read(a.nbytes)
            if after != a.tobytes():
                if not a.flags.writeable:
                    raise AssertionError(f"{name} wrote into a read-only input of shape {a.shape}")
                a[...] = np.frombuffer(after, a.dtype).reshape(a.shape)
        return code

    def _read(self, size: int) -> bytes:
        assert self._process.stdout is not None
        chunks, left = [], size
        while left:
            ready, _, _ = select.select([self._process.stdout], [], [], CALL_TIMEOUT_S)
            chunk = os.read(self._process.stdout.fileno(), min(left, 1 << 20)) if ready else b""
            if not chunk:
                raise RuntimeError(f"the Arm kernels under qemu stopped answering: {self._failure()}")
            chunks.append(chunk)
            left -= len(chunk)
        return b"".join(chunks)

    def _read_line(self) -> bytes:
        line = b""
        while not line.endswith(b"\n"):
            line += self._read(1)
        return line

    def _failure(self) -> str:
        code = self._process.poll()
        self._stderr.seek(0)
        said = self._stderr.read().decode(errors="replace").strip()
        return f"exit code {code}, stderr: {said or '(nothing)'}" if code is not None else "timed out"

    def close(self) -> None:
        if self._process.stdin is not None:
            self._process.stdin.close()
        try:
            self._process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()
        self._stderr.close()


@dataclass(frozen=True)
class ArmEntry:
    kernels: ArmKernels
    name: str

    def call_arrays(self, arrays: list[np.ndarray], out: np.ndarray) -> int:
        return self.kernels.call(self.name, [*arrays, out])
