"""Configuration: YAML files validated by typed models (schema.py), read by loader.py."""

from config.loader import ConfigError, load_config
from config.schema import PROJECT_ROOT, ServingConfig

__all__ = ["ConfigError", "load_config", "PROJECT_ROOT", "ServingConfig"]
