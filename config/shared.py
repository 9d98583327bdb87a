"""The sections every model of one server shares, in either form of a config file (one model, or a
repository of several): logging, the front end, the scheduler's policy, Ray, model control."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from config.base import Section
from config.logs import LoggingSection
from config.ray import RaySection
from config.scheduler import SchedulerSection
from config.server import ServerSection

RAY_SERVES_ONE_MODEL = (
    "ray: each replica serves one model (model, runtime, agents), started with it: "
    "models: and model_control_mode explicit are for one server"
)


class SharedSections(Section):
    logging: LoggingSection = Field(default_factory=LoggingSection)
    server: ServerSection = Field(default_factory=ServerSection)
    scheduler: SchedulerSection = Field(default_factory=SchedulerSection)
    ray: RaySection | None = Field(None, description="scaling out on Ray Serve (python -m tools.ray_serve)")
    model_control_mode: Literal["none", "explicit"] = Field(
        "none",
        description="Triton's: none starts every model; explicit starts startup_models and loads or "
        "unloads the others on request (POST /v2/repository/models/{name}/load, /unload)",
    )
    startup_models: list[str] = Field(
        default_factory=list, description="explicit mode: the models started with the launcher"
    )
