"""The MindSpore llm-serving names, read from the active config file, for users coming from upstream.

from config import serving_config
serving_config.agent_ports, serving_config.SERVER_APP_PORT, serving_config.ModelName
"""

from __future__ import annotations

from functools import lru_cache

from config.loader import load_config
from config.serving import ServingConfig

UPSTREAM_NAMES = {
    "agent_ports": lambda c: c.agents.ports,
    "AgentPorts": lambda c: c.agents.ports,
    "agent_ip": lambda c: c.agents.host,
    "start_device_id": lambda c: c.agents.start_device_id,
    "ModelName": lambda c: c.model.name,
    "SERVER_APP_HOST": lambda c: c.server.host,
    "SERVER_APP_PORT": lambda c: c.server.port,
}


@lru_cache(maxsize=1)
def active_config() -> ServingConfig:
    return load_config()


def __getattr__(name: str):
    if name in UPSTREAM_NAMES:
        return UPSTREAM_NAMES[name](active_config())
    raise AttributeError(f"module 'config.serving_config' has no attribute {name!r}")
