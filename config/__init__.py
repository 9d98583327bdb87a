"""Configuration: YAML files validated by typed models (a module per section, gathered in schema.py),
read by loader.py."""

from config.base import PROJECT_ROOT
from config.loader import ConfigError, load_config
from config.serving import ServingConfig

__all__ = ["ConfigError", "load_config", "PROJECT_ROOT", "ServingConfig"]
