"""python -m agent.kernels: build the custom CPU kernels (part of `make setup`)."""

import sys

from agent.kernels import KernelBuildError, build

if __name__ == "__main__":
    try:
        print(f"kernels: {build()}")
    except KernelBuildError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(1)
