"""Docs that cannot drift: every file path the READMEs, the docstrings and the comments name (a path
with a folder: `agent/kernels/fused_layer.cc`, `tests/support/reference_numpy.py`) exists, from the
project's root or from the naming file's folder (a README's `../` links), and the README's wire
protocol version is the code's. Paths outside the project (`../shared/`) and names a user makes up
(`config/my_*.yaml`) are left alone."""

from __future__ import annotations

import ast
import io
import re
import tokenize
from collections.abc import Iterator
from pathlib import Path

from agent.contract.protocol import PROTOCOL_VERSION
from config.schema import PROJECT_ROOT

SKIPPED_FOLDERS = {".venv", ".git", "models", "output", "build", "node_modules", "__pycache__"}
PATH = re.compile(
    r"(?<![\w./-])((?:\.\./|[\w.-]+/)+[\w.-]+\.(?:py|cc|h|md|yaml|yml|jsonl|jinja|proto|toml))\b"
)
OUTSIDE = ("../shared/", "config/my_")


def project_files(suffix: str) -> Iterator[Path]:
    for path in PROJECT_ROOT.rglob(f"*{suffix}"):
        if not SKIPPED_FOLDERS & set(path.relative_to(PROJECT_ROOT).parts):
            yield path


def python_texts(path: Path) -> Iterator[str]:
    """A module's docstrings and comments."""
    source = path.read_text()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            docstring = ast.get_docstring(node)
            if docstring:
                yield docstring
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            yield token.string


def named_paths() -> Iterator[tuple[Path, str]]:
    for readme in project_files(".md"):
        for name in PATH.findall(readme.read_text()):
            yield readme, name
    for module in project_files(".py"):
        for text in python_texts(module):
            for name in PATH.findall(text):
                yield module, name


def exists(naming: Path, name: str) -> bool:
    return (PROJECT_ROOT / name).exists() or (naming.parent / name).resolve().exists()


def test_every_path_the_docs_name_exists():
    missing = sorted(
        f"{naming.relative_to(PROJECT_ROOT)}: {name}"
        for naming, name in named_paths()
        if not name.startswith(OUTSIDE) and not exists(naming, name)
    )
    assert not missing, missing


def test_the_readme_names_the_codes_protocol_version():
    text = (PROJECT_ROOT / "README.md").read_text()
    said = re.findall(r"agent/contract/protocol\.py`, version (\d+)", text)
    assert said == [str(PROTOCOL_VERSION)], said
