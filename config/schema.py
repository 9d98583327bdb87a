"""Typed configuration: every YAML file in config/ is validated by these models. One module per
section (base, model, runtime, agents, logs, server, scheduler, ray, shared, repository, serving);
this module gathers their public names for the many modules that import them from here."""

from config.agents import AgentKeys, AgentsSection, CurveSection, GroupSection, Role, Z85Key
from config.base import PROJECT_ROOT, Section, is_loopback, resolve_path
from config.logs import LoggingSection
from config.model import ModelSection
from config.ray import RaySection
from config.repository import MODEL_NAME, PER_MODEL_AGENTS, AgentsKeys, ModelEntry, RepositoryConfig
from config.runtime import RuntimeSection, SpeculationSection
from config.scheduler import SchedulerSection
from config.server import ServerSection
from config.serving import ServingConfig
from config.shared import SharedSections

__all__ = [
    "MODEL_NAME",
    "PER_MODEL_AGENTS",
    "PROJECT_ROOT",
    "AgentKeys",
    "AgentsKeys",
    "AgentsSection",
    "CurveSection",
    "GroupSection",
    "LoggingSection",
    "ModelEntry",
    "RepositoryConfig",
    "ModelSection",
    "RaySection",
    "Role",
    "RuntimeSection",
    "SchedulerSection",
    "Section",
    "ServerSection",
    "ServingConfig",
    "SharedSections",
    "SpeculationSection",
    "Z85Key",
    "is_loopback",
    "resolve_path",
]
