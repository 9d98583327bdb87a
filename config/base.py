"""What every config section shares: the project root relative paths resolve against, and the
section base that refuses unknown keys."""

from __future__ import annotations

import ipaddress
from pathlib import Path

from pydantic import BaseModel, ConfigDict

PROJECT_ROOT = Path(__file__).resolve().parent.parent


def resolve_path(path: Path) -> Path:
    """Relative paths in config files are relative to the project root, not the working directory."""
    return path if path.is_absolute() else PROJECT_ROOT / path


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid")
