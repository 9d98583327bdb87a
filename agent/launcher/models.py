"""LaunchedModels: the agent launcher's models, one AgentLauncher each (config.model_configs()).

    models = LaunchedModels(config)
    models.start()             # the startup models' agents, then "all agents started"
    code = models.supervise()  # until SIGTERM/SIGINT (0), answering the control channel

model_control_mode none starts every model, and a model whose agents cannot be mended stops the
launcher (exit 1), as with one model. explicit starts config.startup_models and answers the control
channel (agent/launcher/control.py): a load spawns the model's agents, within the memory budget
(agent/launcher/memory_budget.py), and is followed between supervision passes until they are ready; an
unload stops them (SIGTERM, SIGKILL after agents.shutdown_grace_s). A model that fails to load (its
agents' error, or the spawn itself), or whose agents die beyond the restart policy, is UNAVAILABLE
with the reason; the launcher and the other models go on.
"""

from __future__ import annotations

import logging
import signal
import time
from dataclasses import dataclass

import zmq

from agent.contract import launcher_control as control
from agent.launcher.control import ControlChannel
from agent.launcher.memory_budget import device_refusal, need_mb, refusal
from agent.launcher.model_agents import POLL_S, AgentLauncher, LaunchError
from config.schema import ServingConfig

log = logging.getLogger("agent_launcher")


@dataclass
class LaunchedModel:
    name: str
    config: ServingConfig
    launcher: AgentLauncher | None = None
    state: str = control.UNAVAILABLE
    reason: str = "unloaded"
    need_mb: int | None = None  # what its agents plan to hold while loading or loaded
    devices: tuple[int, ...] = ()  # Ascend/GPU: the devices they hold it on (budget_mb each)
    since: float = 0.0  # when its load or unload began


class LaunchedModels:
    def __init__(self, config: ServingConfig, groups: list[int] | None = None):
        """groups: multi-host, the agent groups this machine runs (one model only)."""
        self.config = config
        self.explicit = config.model_control_mode == "explicit"
        self.models = {name: LaunchedModel(name, c) for name, c in config.model_configs().items()}
        if groups is not None and len(self.models) > 1:
            raise LaunchError(
                "--groups picks agent groups of one model: a config with models: runs them all here"
            )
        self.groups = groups
        self.named = len(self.models) > 1 or self.explicit  # log lines name their model
        self.control: ControlChannel | None = None
        self.stop_signal: int | None = None

    def install_signal_handlers(self) -> None:
        def handler(signum, _frame):
            self.stop_signal = signum

        signal.signal(signal.SIGTERM, handler)
        signal.signal(signal.SIGINT, handler)

    # ------------------------------------------------------------------------------ start-up

    def start(self) -> None:
        """The control channel (explicit mode), then the startup models, until every one is ready.
        LaunchError, with everything stopped, when one fails."""
        try:
            if self.explicit:
                try:
                    self.control = ControlChannel(self.config)
                except (zmq.ZMQError, ValueError) as exc:
                    port = self.config.agents.control_port
                    raise LaunchError(f"the control channel (agents.control_port {port}): {exc}") from exc
            for name in self.config.startup():
                problem = self._load(self.models[name])
                if problem is not None:
                    raise LaunchError(problem)
            while loading := self._in_state(control.LOADING):
                if self.stop_signal is not None:
                    raise LaunchError(f"interrupted by signal {self.stop_signal} during start-up")
                for model in loading:
                    failure = self._follow_load(model, POLL_S / len(loading))
                    if failure is not None:
                        raise LaunchError(failure)
        except LaunchError:
            self.stop()
            raise
        log.info("all agents started")

    def _in_state(self, state: str) -> list[LaunchedModel]:
        return [m for m in self.models.values() if m.state == state]

    def _load(self, model: LaunchedModel) -> str | None:
        """Spawn the model's agents (idempotent); why not, when its memory does not fit or the
        spawn itself failed (then whatever it started is stopped: that load fails, nothing else)."""
        if model.state in (control.READY, control.LOADING):
            return None
        try:
            return self._spawn(model)
        except LaunchError as exc:
            reason = str(exc)
        except Exception as exc:  # process or file-descriptor limits, a broken pipe: this load's failure
            log.exception("model %s: starting its agents failed", model.name)
            reason = f"starting its agents failed: {type(exc).__name__}: {exc}"
        self._stopped(model, control.clip(reason))
        return reason

    def _spawn(self, model: LaunchedModel) -> str | None:
        launcher = AgentLauncher(model.config, self.groups, f"{model.name}: " if self.named else "")
        agents = len(launcher.agents)
        need = need_mb(model.config, agents)
        active = [
            m for m in self.models.values() if m.state in (control.READY, control.LOADING) and m.need_mb
        ]
        runtime, policy = model.config.runtime, model.config.agents
        on_host = runtime.device_target == "CPU"
        devices = () if on_host else tuple(policy.device_id(rank) for rank in launcher.agents)
        problem = refusal(
            model.name,
            need,
            agents,
            self.config.agents.memory_limit_mb,
            {m.name: m.need_mb or 0 for m in active},
            {m.name: m.need_mb or 0 for m in active if m.state == control.LOADING},
            host=on_host,
        ) or device_refusal(
            model.name,
            runtime.memory_budget_mb,
            list(devices),
            policy.device_memory_mb,
            {m.name: (m.config.runtime.memory_budget_mb or 0, list(m.devices)) for m in active},
        )
        if problem is not None:
            model.reason = problem
            log.error("load refused: %s", problem)
            return problem
        log.info("loading model %s (%d agent(s)%s)", model.name, agents, f", {need} MB" if need else "")
        model.launcher, model.need_mb, model.since = launcher, need, time.monotonic()
        model.devices = devices
        model.state, model.reason = control.LOADING, ""
        launcher.begin_start()
        return None

    def _follow_load(self, model: LaunchedModel, timeout_s: float) -> str | None:
        """One look at a loading model: READY once every agent is; the failure, when one failed
        (its agents then stopped, the model UNAVAILABLE)."""
        assert model.launcher is not None
        try:
            if model.launcher.poll_start(timeout_s):
                model.state = control.READY
                log.info("model %s ready (load %.1fs)", model.name, time.monotonic() - model.since)
            return None
        except LaunchError as exc:
            log.error("model %s failed to load: %s", model.name, exc)
            self._stopped(model, control.clip(str(exc)))
            return str(exc)

    def _stopped(self, model: LaunchedModel, reason: str) -> bool:
        """Stop the model's agents; True when none is left."""
        gone = True if model.launcher is None else model.launcher.stop()
        model.launcher, model.need_mb, model.devices = None, None, ()
        model.state, model.reason = control.UNAVAILABLE, reason
        return gone

    # ---------------------------------------------------------------------------- supervision

    def supervise(self) -> int:
        """Until a stop signal (0 once every agent is gone); 1 when a model's agents cannot be
        mended in mode none."""
        while self.stop_signal is None:
            if self.control is not None:
                self.control.answer(self._handle, POLL_S)  # the wait between passes
            active = [m for m in self.models.values() if m.launcher is not None]
            if self.control is None and not active:
                time.sleep(POLL_S)
            wait = 0.0 if self.control is not None else POLL_S / max(1, len(active))
            for model in active:
                failure = self._supervise_one(model, wait)
                if failure is None:
                    continue
                if not self.explicit:
                    log.error(
                        "%s%s: stopping all agents", f"model {model.name}: " if self.named else "", failure
                    )
                    self.stop()
                    return 1
                log.error("model %s: %s: stopping its agents", model.name, failure)
                self._stopped(model, failure)
        log.info("signal %d received: stopping agents", self.stop_signal)
        return 0 if self.stop() else 1

    def _supervise_one(self, model: LaunchedModel, wait: float) -> str | None:
        """One pass over a model's agents: a loading model followed, a loaded one mended; why its
        agents cannot go on (a failed load has already stopped them). An unforeseen failure here
        (a restart whose spawn fails) is that model's failure, never the launcher's."""
        try:
            if model.state == control.LOADING:
                self._follow_load(model, wait)
                return None
            assert model.launcher is not None  # active
            return model.launcher.mend(wait)
        except Exception as exc:
            log.exception("model %s: supervising its agents failed", model.name)
            return f"supervising its agents failed: {type(exc).__name__}: {exc}"

    def stop(self) -> bool:
        """Every model's agents; True when none is left."""
        stopped = [self._stopped(m, "the launcher stopped") for m in self.models.values() if m.launcher]
        gone = all(stopped)  # every model stopped, even after one that left a process behind
        if self.control is not None:
            self.control.close()
            self.control = None
        return gone

    # ----------------------------------------------------------------------- control requests

    def _handle(self, message: dict) -> dict:
        op = message.get("op")
        if op == "status":  # of every model, or of the one named (a reply stays within the bound)
            name = message.get("model")
            named = [name] if isinstance(name, str) and name in self.models else self.models
            return {"ok": True, "models": {name: self._status(self.models[name]) for name in named}}
        if op not in control.OPS:
            return {"ok": False, "error": f"unknown op {op!r} (ops: {', '.join(control.OPS)})"}
        name = message.get("model")
        model = self.models.get(name) if isinstance(name, str) else None
        if model is None:
            return {
                "ok": False,
                "error": f"no model {name!r} in the launcher's config ({', '.join(self.models)})",
            }
        if op == "load":
            problem = self._load(model)
            if problem is not None:
                return {"ok": False, "error": control.clip(problem)}
        elif model.launcher is not None:
            start = time.monotonic()
            model.state = control.UNLOADING
            self._stopped(model, "unloaded")
            log.info("model %s unloaded (%.1fs)", model.name, time.monotonic() - start)
        return {"ok": True, "state": model.state}

    def _status(self, model: LaunchedModel) -> dict:
        return {
            "state": model.state,
            "reason": model.reason,
            "pids": [] if model.launcher is None else model.launcher.pids,
            "memory_mb": model.need_mb,
        }
