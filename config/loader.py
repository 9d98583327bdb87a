"""Reads a YAML config file into a validated ServingConfig, with errors that name the bad key."""
from __future__ import annotations

from pathlib import Path

import yaml
from pydantic import ValidationError

from config.schema import PROJECT_ROOT, ServingConfig

DEFAULT_CONFIG = PROJECT_ROOT / "config" / "default.yaml"


class ConfigError(Exception):
    """A config file that cannot be read or does not validate."""


def load_config(path: str | Path | None = None) -> ServingConfig:
    path = Path(path) if path is not None else DEFAULT_CONFIG
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc.strerror}") from exc
    except yaml.YAMLError as exc:
        raise ConfigError(f"config file {path} is not valid YAML: {exc}") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a mapping at the top level")
    try:
        return ServingConfig.model_validate(data)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in err['loc']) or '(top level)'}: {err['msg']}"
            for err in exc.errors())
        raise ConfigError(f"invalid config {path}: {problems}") from exc
