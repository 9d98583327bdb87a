"""python -m agent.kernels: build the custom CPU kernels (part of `make setup`) at this process's
target (MS_LLM_KERNEL_TARGET, default native)."""

import sys

from agent.kernels import KernelBuildError, build, target

if __name__ == "__main__":
    try:
        print(f"kernels ({target()} target): {build()}")
    except KernelBuildError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(1)
