"""The repository form of a config file: several models in one server (`models:`), each with the
model section's keys plus its own runtime and agents; the top-level agents keys (but the ports,
groups and CPU sets, which are each model's own) are every model's defaults.

RepositoryConfig parses that form as it is written; ServingConfig (config/serving.py) builds each
model's one-model config from it."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pydantic import Field, create_model, field_validator, model_validator

from config.agents import AgentsSection, CurveSection
from config.base import Section
from config.model import ModelSection
from config.runtime import RuntimeSection
from config.shared import RAY_SERVES_ONE_MODEL, SharedSections

MODEL_NAME = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$"  # a log folder's name and a metric label
# Launcher settings of the agents section that are the same for every model of a repository.
PER_MODEL_AGENTS = ("ports", "groups", "cpu_affinity")


def _optional_keys(section: type[Section], name: str, **nested: type[Section]) -> type[Section]:
    """`section`'s keys, each optional and unset unless given (`nested`: a section key's own layer):
    one layer of keys over another, checked as a whole once layered (its rules need both layers)."""
    fields: dict[str, Any] = {}
    for key, info in section.model_fields.items():
        annotation: Any = nested.get(key, info.annotation)
        fields[key] = (annotation | None, Field(None, description=info.description))
    return create_model(name, __base__=Section, **fields)


if TYPE_CHECKING:  # built from the sections' fields below; a type checker sees the Section they are
    CurveKeys = Section
    AgentsKeys = Section
else:
    # A repository with CURVE: the server's and launcher's keys shared, each model its agents' keys.
    CurveKeys = _optional_keys(CurveSection, "CurveKeys")
    AgentsKeys = _optional_keys(AgentsSection, "AgentsKeys", curve=CurveKeys)


class ModelEntry(ModelSection):
    """One model of a repository: the model section's keys plus its own runtime and agents keys
    (over the top-level agents section's)."""

    name: str = Field(pattern=MODEL_NAME, description="served model name; also its log folder's")
    runtime: RuntimeSection = Field(default_factory=RuntimeSection)
    agents: AgentsKeys = Field(default_factory=AgentsKeys)

    def section(self) -> ModelSection:
        return ModelSection.model_validate(self.model_dump(include=set(ModelSection.model_fields)))


class RepositoryConfig(SharedSections):
    """Several models in one server (Triton's model repository): `models`, and the sections they
    share."""

    models: list[ModelEntry] = Field(
        min_length=1, description="several models in one server (model, runtime, agents each)"
    )
    agents: AgentsKeys = Field(
        default_factory=AgentsKeys, description="every model's agents keys, but ports, groups, cpu_affinity"
    )

    @model_validator(mode="before")
    @classmethod
    def _not_both_forms(cls, data):
        if isinstance(data, dict) and ("model" in data or "runtime" in data):
            raise ValueError("give either model and runtime (one model) or models (several), not both")
        return data

    @field_validator("agents")
    @classmethod
    def _shared_agents(cls, agents: Section) -> Section:
        misplaced = [key for key in PER_MODEL_AGENTS if key in agents.model_fields_set]
        if misplaced:
            raise ValueError(
                f"agents.{misplaced[0]} belongs in each model's own agents section (models[i].agents)"
            )
        return agents

    @model_validator(mode="after")
    def _ray_serves_one_model(self) -> RepositoryConfig:
        if self.ray is not None:
            raise ValueError(RAY_SERVES_ONE_MODEL)
        return self

    def agents_of(self, entry: ModelEntry) -> AgentsSection:
        """The entry's agents keys over the shared ones, and its curve keys over the shared curve's."""
        shared, own = self.agents.model_dump(exclude_unset=True), entry.agents.model_dump(exclude_unset=True)
        if shared.get("curve") and own.get("curve"):
            own["curve"] = {**shared["curve"], **own["curve"]}
        return AgentsSection.model_validate({**shared, **own})
