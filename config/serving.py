"""ServingConfig: one model's config (`model`, `runtime`, `agents` and the shared sections), what
every process runs by; a file in the repository form (`models:`) is parsed by RepositoryConfig and
gives one such config per model (model_configs())."""

from __future__ import annotations

from pydantic import Field, PrivateAttr, ValidationError, model_validator

from config.agents import AgentsSection
from config.model import ModelSection
from config.repository import ModelEntry, RepositoryConfig
from config.runtime import RuntimeSection
from config.shared import RAY_SERVES_ONE_MODEL, SharedSections


class ServingConfig(SharedSections):
    """One model (`model`, `runtime`, `agents`). Validating the repository form (`models:`) gives
    its first model's config (for the tools that run one model), with model_configs() each model's
    and startup_models the repository's."""

    model: ModelSection = Field(default_factory=ModelSection)
    runtime: RuntimeSection = Field(default_factory=RuntimeSection)
    agents: AgentsSection = Field(default_factory=AgentsSection)
    _configs: dict[str, ServingConfig] = PrivateAttr(default_factory=dict)

    @model_validator(mode="wrap")
    @classmethod
    def _repository_form(cls, data, handler):
        """The repository form is its own type: parsed by RepositoryConfig, each model's config built
        from its typed sections; this config is the first model's with the repository's sections."""
        if not isinstance(data, dict) or "models" not in data:
            return handler(data)
        repository = RepositoryConfig.model_validate(data)
        configs = {
            entry.name: cls._of_entry(repository, i, entry) for i, entry in enumerate(repository.models)
        }
        first = next(iter(configs.values()))
        check_served_models(configs, repository.model_control_mode, repository.startup_models, first.agents)
        # startup_models only once the configs are there: the first model alone does not know them all
        config = handler(
            {
                "model": first.model,
                "runtime": first.runtime,
                "agents": first.agents,
                "logging": repository.logging,
                "server": repository.server,
                "scheduler": repository.scheduler,
                "model_control_mode": repository.model_control_mode,
            }
        )
        config.startup_models, config._configs = repository.startup_models, configs
        return config

    @classmethod
    def _of_entry(cls, repository: RepositoryConfig, index: int, entry: ModelEntry) -> ServingConfig:
        """One repository model's config in the one-model form; its agents log in a folder of its own."""
        where = f"models[{index}] ({entry.name})"
        try:
            agents = repository.agents_of(entry)
        except ValidationError as exc:
            raise ValueError(f"{where}: {_problems(exc, 'agents.')}") from None
        try:
            return cls(
                model=entry.section(),
                runtime=entry.runtime,
                agents=agents,
                logging=repository.logging.model_copy(update={"dir": repository.logging.dir / entry.name}),
                server=repository.server,
                scheduler=repository.scheduler,
            )
        except ValidationError as exc:
            raise ValueError(f"{where}: {_problems(exc)}") from None

    @model_validator(mode="after")
    def _models_apart(self) -> ServingConfig:
        check_served_models(self.model_configs(), self.model_control_mode, self.startup_models, self.agents)
        return self

    def model_configs(self) -> dict[str, ServingConfig]:
        """Each model's config in the one-model form (a one-model config: itself), by name."""
        return self._configs or {self.model.name: self}

    def startup(self) -> list[str]:
        """The models started with the launcher (and connected by the server at its start)."""
        return list(self.model_configs()) if self.model_control_mode == "none" else self.startup_models

    @model_validator(mode="after")
    def _ray_serves_one_model(self) -> ServingConfig:
        if self.ray is not None and self.model_control_mode == "explicit":
            raise ValueError(RAY_SERVES_ONE_MODEL)
        return self

    @model_validator(mode="after")
    def _groups_fit_the_runtime(self) -> ServingConfig:
        largest = self.runtime.decode_batch_buckets[-1]
        for index, group in enumerate(self.agents.groups):
            if group.num_slots is not None and group.num_slots > largest:
                raise ValueError(
                    f"agents.groups[{index}].num_slots ({group.num_slots}) exceeds the "
                    f"largest of runtime.decode_batch_buckets ({largest})"
                )
        return self

    @model_validator(mode="after")
    def _step_budget_leaves_room_for_prompts(self) -> ServingConfig:
        rows = self.runtime.decode_batch_buckets[-1]
        if self.scheduler.max_num_batched_tokens <= rows:
            raise ValueError(
                f"scheduler.max_num_batched_tokens ({self.scheduler.max_num_batched_tokens}) must exceed the "
                f"largest decode batch ({rows}): a step whose every slot decodes would leave no "
                f"positions for prompts, which would wait until a stream ends"
            )
        return self

    @model_validator(mode="after")
    def _disaggregation_needs_code_graphs(self) -> ServingConfig:
        roles = set(self.agents.roles)
        if self.model.uses_mindir and roles != {"mixed"}:
            raise ValueError(
                "prefill and decode groups run the KV transfer graphs, which MindIR "
                "exports do not hold: serve them from model.path"
            )
        if self.model.uses_mindir and any(g.tensor_parallel > 1 for g in self.agents.groups):
            raise ValueError(
                "tensor-parallel groups build split graphs from model.path; MindIR "
                "exports hold the whole model"
            )
        if self.runtime.kv_cache_dtype == "q8_0" and any(g.tensor_parallel > 1 for g in self.agents.groups):
            raise ValueError(
                "runtime.kv_cache_dtype: q8_0 is written and read by the fused CPU layer kernel, which "
                "runs a whole layer: tensor-parallel groups keep kv_cache_dtype auto"
            )
        if self.model.uses_mindir and self.runtime.kv_cache_dtype == "q8_0":
            raise ValueError(
                "runtime.kv_cache_dtype: q8_0 is a cache of graphs built from model.path; a MindIR "
                "export holds the cache it was exported with"
            )
        if self.model.uses_mindir and self.runtime.activations == "int8":
            raise ValueError(
                "runtime.activations: int8 picks the kernels of graphs built from model.path; "
                "a MindIR export holds the ops it was exported with"
            )
        return self


def check_served_models(
    configs: dict[str, ServingConfig], mode: str, startup_models: list[str], agents: AgentsSection
) -> None:
    """What the models of one server must keep apart (names, ports) and agree on (which start, the
    control channel's keys, the memory limit); `agents`: the launcher's (the first model's)."""
    names = [name for c in configs.values() for name in (c.model.name, *c.model.aliases)]
    twice = sorted({name for name in names if names.count(name) > 1})
    if twice:
        raise ValueError(f"model name or alias {twice[0]!r} is given to more than one model")
    ports = [p for c in configs.values() for p in c.agents.ports]
    ports += [g.cluster_port for c in configs.values() for g in c.agents.groups if g.cluster_port]
    if mode == "explicit":
        ports.append(agents.control_port)
    taken = sorted({port for port in ports if ports.count(port) > 1})
    if taken:
        raise ValueError(f"port {taken[0]} is given twice (agents, cluster schedulers, agents.control_port)")
    unknown = [name for name in startup_models if name not in configs]
    if unknown:
        raise ValueError(f"startup_models: {unknown[0]!r} is not a model name ({', '.join(configs)})")
    if startup_models and mode == "none":
        raise ValueError("startup_models is for model_control_mode explicit (none starts every model)")
    curve = agents.curve
    secured = any(c.agents.curve is not None for c in configs.values())
    if mode == "explicit" and secured and (curve is None or curve.launcher is None):
        raise ValueError(
            "agents.curve.launcher is missing: the agents use CURVE, so the launcher's control "
            "channel (model_control_mode explicit) must too; `python -m tools.curve_keys --launcher` "
            "prints a keypair for it"
        )
    if agents.memory_limit_mb is not None:
        unplanned = [n for n, c in configs.items() if c.runtime.memory_budget_mb is None]
        if unplanned:
            raise ValueError(
                f"agents.memory_limit_mb needs every model's runtime.memory_budget_mb "
                f"(what its agents may use); {unplanned[0]!r} has none"
            )


def _problems(exc: ValidationError, prefix: str = "") -> str:
    """Each error with its key, from the model's section (`prefix`) on."""
    keys = [prefix + ".".join(str(part) for part in e["loc"]) for e in exc.errors()]
    return "; ".join(f"{key}: {e['msg']}" if e["loc"] else e["msg"] for key, e in zip(keys, exc.errors()))
