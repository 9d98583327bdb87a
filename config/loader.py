"""Reads a YAML config file into a validated ServingConfig, with errors that name the bad key.

The file is --config PATH, else $LLM_SERVING_CONFIG, else config/default.yaml. Environment variables
LLM_SERVING__<SECTION>__<KEY>=<YAML value> override single keys, e.g.
LLM_SERVING__AGENTS__PORTS="[9900, 9901]". LLM_SERVING_API_KEYS=key1,key2 adds API keys to
server.api_keys, LLM_SERVING_ADMIN_API_KEYS to server.admin_api_keys (keys are better kept out of files).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

import yaml
from pydantic import ValidationError

from config.base import PROJECT_ROOT
from config.serving import ServingConfig

DEFAULT_CONFIG = PROJECT_ROOT / "config" / "default.yaml"
CONFIG_ENV = "LLM_SERVING_CONFIG"
OVERRIDE_PREFIX = "LLM_SERVING__"
API_KEYS_ENV = "LLM_SERVING_API_KEYS"
ADMIN_API_KEYS_ENV = "LLM_SERVING_ADMIN_API_KEYS"


class ConfigError(Exception):
    """A config file that cannot be read or does not validate."""


def load_config(path: str | Path | None = None, environ: Mapping[str, str] = os.environ) -> ServingConfig:
    path = Path(path or environ.get(CONFIG_ENV) or DEFAULT_CONFIG)
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc.strerror}") from exc
    except yaml.YAMLError as exc:
        raise ConfigError(f"config file {path} is not valid YAML: {exc}") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a mapping at the top level")
    _apply_overrides(data, environ)
    for variable, field in ((API_KEYS_ENV, "api_keys"), (ADMIN_API_KEYS_ENV, "admin_api_keys")):
        env_keys = [k.strip() for k in environ.get(variable, "").split(",") if k.strip()]
        if env_keys:
            server = data.setdefault("server", {})
            if not isinstance(server, dict):
                raise ConfigError(f"config file {path}: server must be a section")
            server[field] = [*(server.get(field) or []), *env_keys]
    try:
        return ServingConfig.model_validate(data)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in err['loc']) or '(top level)'}: {err['msg']}" for err in exc.errors()
        )
        raise ConfigError(f"invalid config {path}: {problems}") from exc


def _apply_overrides(data: dict, environ: Mapping[str, str]) -> None:
    for name, raw in environ.items():
        if not name.startswith(OVERRIDE_PREFIX):
            continue
        keys = [k.lower() for k in name[len(OVERRIDE_PREFIX) :].split("__")]
        try:
            value = yaml.safe_load(raw)
        except yaml.YAMLError as exc:
            raise ConfigError(f"environment override {name} is not a YAML value: {exc}") from exc
        target = data
        for key in keys[:-1]:
            target = target.setdefault(key, {})
            if not isinstance(target, dict):
                raise ConfigError(f"environment override {name}: {key} is not a section")
        target[keys[-1]] = value
