"""python -m agent.kernels: build the custom CPU kernels (part of `make setup`)."""

import sys

from agent.kernels import KERNELS, KernelBuildError, build

if __name__ == "__main__":
    try:
        for name in KERNELS:
            print(f"kernel {name}: {build(name)}")
    except KernelBuildError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(1)
