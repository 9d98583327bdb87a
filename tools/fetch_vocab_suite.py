"""Fetch llama.cpp's tokenizer test suite: its vocabularies (models/ggml-vocab-*.gguf) with their
.inp/.out files (texts, and the ids the family's reference Hugging Face tokenizer gives them), and
llama.cpp's MIT licence, from the llama-cpp-python source package on PyPI, which holds llama.cpp's
tree (vendor/llama.cpp). tests/unit/agent/test_tokenizer_suite.py runs it.

    python -m tools.fetch_vocab_suite [--dest models/llama-vocab]

The 15 vocabularies with test files weigh 63 MB (gemma-4 16 MB, command-r 11 MB, llama-bpe 8 MB,
qwen2 and qwen35 6 MB each ...): too much to keep in the repository, so `make setup-dev` fetches
them once. One pinned archive (77 MB) from PyPI's file host, never a model hub, its SHA-256 checked;
only the suite's files are extracted, and their set is checked against a pinned SHA-256 (over each
file's name and SHA-256) on this run and every later one: a changed or missing file means fetching
anew.
"""

from __future__ import annotations

import argparse
import hashlib
import shutil
import sys
import tarfile
import tempfile
import urllib.request
from pathlib import Path

from config.schema import PROJECT_ROOT
from tools.fetch_model import FetchError, sha256_of

DEFAULT_DEST = PROJECT_ROOT / "models" / "llama-vocab"
ARCHIVE_URL = (
    "https://files.pythonhosted.org/packages/ec/e9/e7de2b0463ea3ffbf0ede6cb21b58c1258a8f6521aae45ca773a59fe7cf3/"
    "llama_cpp_python-0.3.36.tar.gz"
)
ARCHIVE_SHA256 = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"
ROOT = "llama_cpp_python-0.3.36/vendor/llama.cpp/"
VOCABULARIES = (
    "bert-bge",
    "command-r",
    "deepseek-coder",
    "deepseek-llm",
    "falcon",
    "gemma-4",
    "gpt-2",
    "llama-bpe",
    "llama-spm",
    "mpt",
    "phi-3",
    "qwen2",
    "qwen35",
    "refact",
    "starcoder",
)
FILES = ("LICENSE", *(f"ggml-vocab-{v}.gguf{ext}" for v in VOCABULARIES for ext in ("", ".inp", ".out")))
SUITE_SHA256 = "875a11849932c80112f8558c74f20c3f760f70323ae383b80671278d2cb692c5"


def suite_digest(dest: Path) -> str | None:
    """The SHA-256 over each suite file's name and SHA-256 (None when one is missing)."""
    digest = hashlib.sha256()
    for name in FILES:
        path = dest / name
        if not path.is_file():
            return None
        digest.update(f"{name} {sha256_of(path)}\n".encode())
    return digest.hexdigest()


def fetch_vocab_suite(dest: Path = DEFAULT_DEST, log=print) -> Path:
    if suite_digest(dest) == SUITE_SHA256:
        log(f"tokenizer suite present: {dest} (SHA-256 verified)")
        return dest
    with tempfile.TemporaryDirectory(prefix="fetch-vocab-") as tmp:
        archive = Path(tmp) / "llama_cpp_python.tar.gz"
        log(f"downloading {ARCHIVE_URL.rsplit('/', 1)[1]} (77 MB, llama.cpp's tokenizer suite)...")
        try:
            with urllib.request.urlopen(ARCHIVE_URL, timeout=180) as src, archive.open("wb") as out:
                shutil.copyfileobj(src, out, 1 << 20)
        except OSError as exc:
            raise FetchError(f"download of {ARCHIVE_URL} failed ({exc}); is PyPI reachable?") from exc
        if sha256_of(archive) != ARCHIVE_SHA256:
            raise FetchError(f"{ARCHIVE_URL}: SHA-256 mismatch; refusing to use it")
        staging = Path(tmp) / "suite"
        staging.mkdir()
        with tarfile.open(archive) as tar:
            for name in FILES:
                member = tar.extractfile(f"{ROOT}{name}" if name == "LICENSE" else f"{ROOT}models/{name}")
                if member is None:
                    raise FetchError(f"{name} is not a file in {ARCHIVE_URL}")
                with member, (staging / name).open("wb") as out:
                    shutil.copyfileobj(member, out, 1 << 20)
        if suite_digest(staging) != SUITE_SHA256:
            raise FetchError("the extracted tokenizer suite does not match its SHA-256")
        dest.mkdir(parents=True, exist_ok=True)
        for name in FILES:
            shutil.move(staging / name, dest / name)
    log(f"tokenizer suite ready: {dest} ({len(VOCABULARIES)} vocabularies, SHA-256 verified)")
    return dest


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dest", type=Path, default=DEFAULT_DEST)
    args = parser.parse_args()
    try:
        fetch_vocab_suite(args.dest)
    except FetchError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
