"""ModelRepository: the server's models by name and alias, each in one of Triton's states (READY,
LOADING, UNLOADING, UNAVAILABLE with a reason) and, while loaded, with its tokenizer, answer streams
and engine (a ServedModel). Routes find a model with serving(name): 404 for a name no model has
(listing them), 503 naming the state of one that is not READY.

    repository = ModelRepository(config, {name: tokenizer})   # the startup models' tokenizers
    await repository.start()          # connects the startup models (up to server.agent_wait_s)
    model = repository.serving("smollm2")   # a LoadedModel: .outputs, .encoder, .grammars, ...
    await repository.load(name); await repository.unload(name)   # model_control_mode explicit
    await repository.drain(timeout_s) # SIGTERM: every model's

A load asks the agent launcher (server/launcher_client.py) to start the model's agents, follows
them until they are warm (a failure's reason is the failing agent's error and last log lines), then
connects an engine: the model is routable only then. An unload refuses new requests (503 naming
the state), drains the model's running ones (they finish, or end with an "error" event after
server.drain_timeout_s), then has the launcher stop its agents. Loads and unloads are serialised
per model (a lock each) and idempotent; other models are never touched.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

from agent.contract.launcher_control import LOADING, READY, UNAVAILABLE, UNLOADING
from agent.model.tokenizer import TextTokenizer, TokenizerError, load_tokenizer
from config.schema import ServingConfig
from scheduler.agent_client import AgentError
from scheduler.engine import Engine
from server import reasoning
from server.engine_client import EngineClient
from server.errors import ApiError
from server.launcher_client import LauncherClient, LauncherError
from server.logprob_format import LogprobFormatter
from server.metrics import MetricsByModel, ModelMetrics
from server.output import OutputProcessor
from server.pooling import Pooling, PoolingError, model_pooling
from server.prompt_encoder import PromptEncoder
from server.structured_output import Grammars
from server.tracing import Tracing

log = logging.getLogger(__name__)
STATUS_POLL_S = 0.25  # how often a load asks the launcher how its agents are doing


class LoadFailed(Exception):
    """Why a model could not be loaded."""


@dataclass
class LoadedModel:
    """What the routes use of a loaded model: its engine and its answer streams, built side by side
    (the engine reports each sequence to the streams' update), its prompt encoder, grammars and
    logprob formatter."""

    name: str
    config: ServingConfig
    engine: Engine
    outputs: OutputProcessor
    client: EngineClient  # what the routes drive: the engine and its answer streams together
    encoder: PromptEncoder
    grammars: Grammars
    formatter: LogprobFormatter
    pooling: Pooling  # what its embeddings and scores are (server/pooling.py)

    @property
    def tokenizer(self) -> TextTokenizer:
        return self.outputs.tokenizer

    @property
    def reasons(self) -> bool:
        """Whether its answers are read for thinking (server/reasoning.py)."""
        return reasoning.reasons(self.tokenizer.chat_template, self.config.model.reasoning_parser)

    async def drain(self, timeout_s: float, reason: str | None = None) -> None:
        """Refuse new requests (503) and wait up to `timeout_s` for every open stream to end;
        stopping the engine then ends whatever is left with a final output saying so (`reason`:
        why, default the server is shutting down)."""
        self.engine.refuse_new_requests(reason)
        deadline = time.monotonic() + timeout_s
        streams = self.outputs.streams
        if streams:
            log.info("model %s: draining %d request(s), up to %gs", self.name, len(streams), timeout_s)
        while streams and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if streams:
            log.warning("model %s: drain timeout: ending %d unfinished request(s)", self.name, len(streams))
        await self.engine.stop(reason)


@dataclass
class ServedModel:
    name: str
    config: ServingConfig
    state: str = UNAVAILABLE
    reason: str = "unloaded"
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    loaded: LoadedModel | None = None  # while loaded (and while loading, once its tokenizer is read)
    watch: asyncio.Task | None = None  # waits for its engine's death

    @property
    def names(self) -> list[str]:
        return [self.name, *self.config.model.aliases]

    def status(self) -> str:
        return self.state + (f" ({self.reason})" if self.reason else "")


class ModelRepository:
    def __init__(self, config: ServingConfig, tokenizers: dict[str, TextTokenizer]):
        self.config = config
        self.metrics = MetricsByModel()
        self.models = {name: ServedModel(name, c) for name, c in config.model_configs().items()}
        self.by_name = {alias: m for m in self.models.values() for alias in m.names}
        self.launcher = LauncherClient(config) if config.model_control_mode == "explicit" else None
        self.started = False  # the startup models connected
        self._adopting: asyncio.Task | None = None  # taking over what the launcher holds
        self.draining = False
        self.failure: str | None = None  # a model's engine died (a bug): the server must restart
        self.dead = asyncio.Event()
        # OpenTelemetry only when server.otlp_endpoint asks for it (server/tracing.py)
        self.tracing = Tracing(config.server) if config.server.otlp_endpoint else None
        for name, tokenizer in tokenizers.items():
            self._assemble(self.models[name], tokenizer)
            self.models[name].state, self.models[name].reason = LOADING, "connecting to its agents"

    # ------------------------------------------------------------------------------ routing

    def resolve(self, name: str | None) -> ServedModel:
        """The model of that name or alias (None: the first configured, as vLLM's one model answers
        a request that names none); 404 otherwise."""
        if name is None:
            return self.first
        model = self.by_name.get(name)
        if model is None:
            raise ApiError(
                404,
                f"model {name!r} is not served here; served: {', '.join(self.by_name)}",
                param="model",
                code="model_not_found",
            )
        return model

    def serving(self, name: str | None) -> LoadedModel:
        """The READY model of that name or alias (None: the first configured); 404 or 503 (naming
        its state) otherwise."""
        model = self.resolve(name)
        if model.state != READY or model.loaded is None:
            raise ApiError(503, f"model {model.name!r} is {model.status()}", param="model")
        return model.loaded

    def loaded(self) -> list[LoadedModel]:
        return [m.loaded for m in self.models.values() if m.loaded is not None]

    def engines(self, name: str | None) -> list[Engine]:
        """Every loaded model's engine, or the named model's (none while it is not loaded)."""
        if name is None:
            return [m.engine for m in self.loaded()]
        loaded = self.resolve(name).loaded
        return [] if loaded is None else [loaded.engine]

    @property
    def first(self) -> ServedModel:
        """The first configured model (what the one-model fields of /info describe)."""
        return next(iter(self.models.values()))

    def open_streams(self) -> int:
        return sum(len(m.outputs.streams) for m in self.loaded())

    # ---------------------------------------------------------------------------- lifecycle

    async def start(self) -> None:
        """Connect every model whose tokenizer was given (the startup models), each up to
        server.agent_wait_s; AgentError when one never answers. In explicit mode, the models the
        launcher holds besides (loaded for an earlier server) are then taken over too."""
        starting = [m for m in self.models.values() if m.loaded is not None]
        await asyncio.gather(*(self._connect(m) for m in starting))
        self.started = True
        if self.launcher is not None:
            self._adopting = asyncio.create_task(self._adopt(self.launcher), name="adopt-models")

    async def _adopt(self, launcher: LauncherClient) -> None:
        try:
            held = (await launcher.call("status"))["models"]
        except LauncherError as exc:
            log.warning("could not ask the agent launcher which models it holds: %s", exc)
            return
        for name, model in self.models.items():
            if model.state == UNAVAILABLE and held.get(name, {}).get("state") == READY:
                log.info("model %s: the launcher holds its agents; connecting", name)
                try:
                    await self.load(name)
                except ApiError as exc:
                    log.warning("model %s: %s", name, exc.message)

    async def _connect(self, model: ServedModel) -> None:
        assert model.loaded is not None
        await model.loaded.engine.start()
        model.state, model.reason = READY, ""
        model.watch = asyncio.create_task(
            self._watch(model.loaded.engine, model.name), name=f"watch-{model.name}"
        )

    async def _watch(self, engine: Engine, name: str) -> None:
        await engine.dead.wait()
        self.failure = f"model {name!r}: {engine.failure}"
        self.dead.set()

    def _assemble(self, model: ServedModel, tokenizer: TextTokenizer) -> None:
        metrics = ModelMetrics()
        traced = self.tracing.answer_ended if self.tracing else None
        outputs = OutputProcessor(tokenizer, metrics.streams, traced)
        vocab_size, eos_ids = tokenizer.vocab_size, tokenizer.eos_ids
        engine = Engine(model.config, vocab_size, eos_ids, outputs.process, metrics.engine)
        model.loaded = LoadedModel(
            model.name,
            model.config,
            engine,
            outputs,
            EngineClient(engine, outputs),
            PromptEncoder(tokenizer, engine),
            Grammars(
                tokenizer,
                model.config.server.max_grammar_bytes,
                model.config.server.grammar_compile_timeout_s,
            ),
            LogprobFormatter(tokenizer),
            model_pooling(model.config.model, tokenizer),
        )
        self.metrics.models[model.name] = metrics

    def _disassemble(self, model: ServedModel) -> None:
        if model.watch is not None:
            model.watch.cancel()
        if model.loaded is not None:
            model.loaded.encoder.pool.shutdown(wait=False)
        self.metrics.models.pop(model.name, None)
        model.loaded, model.watch = None, None

    def _explicit(self) -> LauncherClient:
        if self.launcher is None:
            raise ApiError(
                400,
                "model_control_mode is none: every model is started with the server; set "
                "model_control_mode: explicit to load and unload models at run time",
            )
        if self.draining:
            raise ApiError(503, "the server is shutting down")
        return self.launcher

    async def load(self, name: str) -> ServedModel:
        """The model loaded (already, or now); ApiError 400 with the reason when it cannot be."""
        model = self.resolve(name)
        launcher = self._explicit()
        async with model.lock:
            if model.state == READY:
                return model
            start = time.monotonic()
            model.state, model.reason = LOADING, ""
            log.info("loading model %s", model.name)
            try:
                await self._load(model, launcher)
            except (LoadFailed, LauncherError, TokenizerError, AgentError, PoolingError) as exc:
                model.state, model.reason = UNAVAILABLE, str(exc)
                log.error("model %s failed to load: %s", model.name, exc)
                raise ApiError(400, f"failed to load model {model.name!r}: {exc}", param="model") from exc
            log.info("model %s ready (load %.1fs)", model.name, time.monotonic() - start)
            return model

    async def _load(self, model: ServedModel, launcher: LauncherClient) -> None:
        await launcher.call("load", model=model.name)
        # The tokenizer is read while the agents start; a corrupt file is reported by them.
        tokenizer = asyncio.create_task(asyncio.to_thread(load_tokenizer, model.config.model.path))
        try:
            await self._agents_ready(model, launcher)
            self._assemble(model, await tokenizer)
            await self._connect(model)
        except BaseException:
            await asyncio.gather(tokenizer, return_exceptions=True)
            if model.loaded is not None:
                await model.loaded.engine.stop()
            self._disassemble(model)
            try:  # whatever started goes: its memory is the next load's
                await launcher.call("unload", model=model.name)
            except LauncherError as exc:
                log.warning("model %s: could not unload after the failed load: %s", model.name, exc)
            raise

    async def _agents_ready(self, model: ServedModel, launcher: LauncherClient) -> None:
        deadline = time.monotonic() + model.config.agents.startup_timeout_s + 30
        while time.monotonic() < deadline:
            status = (await launcher.call("status", model=model.name))["models"].get(model.name, {})
            if status.get("state") == READY:
                return
            if status.get("state") == UNAVAILABLE:
                raise LoadFailed(status.get("reason") or "the launcher gave no reason")
            await asyncio.sleep(STATUS_POLL_S)
        raise LoadFailed(f"its agents were not ready after {model.config.agents.startup_timeout_s:g}s")

    async def unload(self, name: str) -> ServedModel:
        """Drain the model's requests, then stop its agents (idempotent)."""
        model = self.resolve(name)
        launcher = self._explicit()
        async with model.lock:
            start = time.monotonic()
            if model.loaded is not None:
                model.state, model.reason = UNLOADING, ""
                log.info("unloading model %s", model.name)
                await model.loaded.drain(
                    self.config.server.drain_timeout_s, f"model {model.name!r} is being unloaded"
                )
                self._disassemble(model)
            try:  # also when unloaded here already: agents a failed load or another server left
                await launcher.call("unload", model=model.name)
            except LauncherError as exc:
                model.state, model.reason = UNAVAILABLE, f"unloaded; stopping its agents failed: {exc}"
                raise ApiError(503, f"model {model.name!r}: {model.reason}", param="model") from exc
            log.info("model %s unloaded (%.1fs)", model.name, time.monotonic() - start)
            model.state, model.reason = UNAVAILABLE, "unloaded"
            return model

    async def drain(self, timeout_s: float) -> None:
        """SIGTERM: every model refuses new requests; the running ones get up to `timeout_s`."""
        self.draining = True
        await asyncio.gather(*(m.drain(timeout_s) for m in self.loaded()))

    def refuse_new_requests(self) -> None:
        for model in self.loaded():
            model.engine.refuse_new_requests()

    async def stop(self) -> None:
        if self._adopting is not None:
            self._adopting.cancel()
        await asyncio.gather(*(m.engine.stop() for m in self.loaded()))
        if self.launcher is not None:
            self.launcher.close()
        if self.tracing is not None:
            await asyncio.to_thread(self.tracing.shutdown)  # the last spans are exported

    async def readiness(self) -> str | None:
        """Why the server cannot serve now: starting, shutting down, or a loaded model's agents."""
        if not self.started:
            return "not started: waiting for the agents"
        if self.draining:
            return "shutting down"
        if self.failure is not None:
            return self.failure
        reasons = []
        for model in self.models.values():
            if model.state == READY and model.loaded is not None:
                reason = await model.loaded.engine.readiness()
                if reason:
                    reasons.append((model, reason))
        if len(self.models) == 1:
            return "; ".join(reason for _, reason in reasons) or None
        return "; ".join(f"model {m.name}: {reason}" for m, reason in reasons) or None
