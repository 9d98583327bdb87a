"""AgentLauncher: the agent processes of one model: one per configured port, started, followed until
ready, supervised. agent/launcher/models.py runs one per model, side by side:

    launcher = AgentLauncher(config)
    launcher.begin_start()                  # spawns every agent
    while not launcher.poll_start(): ...    # logs a readiness line per agent
    failure = launcher.mend()               # now and then: restarts dead agents as the policy allows
    launcher.stop()                         # SIGTERM, SIGKILL after agents.shutdown_grace_s

A start-up failure (LaunchError) reports the failing agent's error and its last log lines.

A tensor-parallel group also gets a MindSpore cluster scheduler process (dynamic cluster: the
MS_* environment variables below); its agents are workers of that cluster. The collectives inside
their graphs need every rank, so when one dies the whole group (scheduler included) is restarted.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import queue
import time
from collections import deque
from contextlib import contextmanager
from dataclasses import dataclass, field

from agent.process_env import device_defaults
from config.logs import agent_log_filename
from config.schema import ServingConfig

log = logging.getLogger("agent_launcher")
POLL_S = 0.2
LOG_TAIL_LINES = 15


# The spawned processes' entry points. The agent runtime (MindSpore: ~400 MB resident) is imported
# in the children only: the launcher, which only supervises them, stays small.
def _agent_main(config: ServingConfig, rank: int, startup_queue, parent_pid: int) -> None:
    from agent.process import run_agent

    run_agent(config, rank, startup_queue, parent_pid)


def _cluster_main(config: ServingConfig, group: int, parent_pid: int) -> None:
    from agent.process import run_cluster_scheduler

    run_cluster_scheduler(config, group, parent_pid)


class LaunchError(Exception):
    """An agent could not be started; the message says which and why."""


@dataclass
class RestartBudget:
    """At most `limit` restarts within any `window_s` seconds: a crash loop still stops the launcher,
    while crashes far apart (one a day) never add up to it."""

    limit: int
    window_s: float
    times: deque = field(default_factory=deque)

    def take(self, now: float) -> bool:
        """Whether a restart at `now` is within the budget (then it is counted)."""
        while self.times and now - self.times[0] >= self.window_s:
            self.times.popleft()
        if len(self.times) >= self.limit:
            return False
        self.times.append(now)
        return True


@dataclass
class AgentHandle:
    rank: int
    port: int
    budget: RestartBudget
    process: mp.process.BaseProcess | None = None
    ready: bool = False


class _Prefixed(logging.LoggerAdapter):
    """Log lines of one model's launcher, named by the model where the launcher runs several."""

    def process(self, msg, kwargs):
        return f"{self.extra['prefix']}{msg}", kwargs  # type: ignore[index]


class AgentLauncher:
    def __init__(self, config: ServingConfig, groups: list[int] | None = None, label: str = ""):
        """groups: the indexes (in agents.groups) of the groups to run here; none: all of them.
        Multi-host: each machine runs its own groups from the same config. label: a prefix of
        every log line (the model's name where one launcher runs several)."""
        self.config = config
        self.log = _Prefixed(log, {"prefix": label})
        self.ctx = mp.get_context("spawn")  # MindSpore's runtime threads do not survive fork
        self.startup_queue = self.ctx.Queue()
        all_groups = config.agents.groups
        chosen = range(len(all_groups)) if groups is None else groups
        unknown = [g for g in chosen if not 0 <= g < len(all_groups)]
        if unknown:
            raise LaunchError(f"no agent group {unknown[0]}: the config has groups 0..{len(all_groups) - 1}")
        ranks = [rank for rank, group in enumerate(config.agents.group_of_rank) if group in chosen]
        curve = config.agents.curve
        missing = [rank for rank in ranks if curve is not None and curve.agents[rank].secret_key is None]
        if missing:
            raise LaunchError(
                f"agents.curve.agents[{missing[0]}] has no secret_key: this machine runs that agent"
            )
        policy = config.agents
        self.agents = {
            rank: AgentHandle(
                rank, policy.ports[rank], RestartBudget(policy.max_restarts, policy.restart_window_s)
            )
            for rank in ranks
        }
        self.clusters: dict[int, mp.process.BaseProcess] = {}  # tensor-parallel group -> scheduler
        self._deadline = 0.0  # of the start-up

    def _cluster_env(self, group: int, role: str, node_id: int | None = None) -> dict[str, str]:
        section = self.config.agents.groups[group]
        env = {
            "MS_ROLE": role,
            "MS_WORKER_NUM": str(section.tensor_parallel),
            "MS_SCHED_HOST": section.host or self.config.agents.host,
            "MS_SCHED_PORT": str(section.cluster_port),
        }
        if node_id is not None:
            env["MS_NODE_ID"] = str(node_id)
        return env

    def _device_env(self) -> dict[str, str]:
        """The device target's defaults (HCCL's and MindSpore's on Ascend) the user has not set."""
        return device_defaults(self.config.runtime.device_target)

    def _start_cluster(self, group: int) -> None:
        """The MindSpore cluster scheduler of a tensor-parallel group (before its workers)."""
        with _environment({**self._device_env(), **self._cluster_env(group, "MS_SCHED")}):
            process = self.ctx.Process(
                target=_cluster_main, name=f"cluster-{group}", args=(self.config, group, os.getpid())
            )
            process.start()
        self.clusters[group] = process
        self.log.info(
            "group %d: MindSpore cluster scheduler (pid %d) on port %d",
            group,
            process.pid,
            self.config.agents.groups[group].cluster_port,
        )

    # ------------------------------------------------------------------------------ start-up

    def begin_start(self) -> None:
        """Spawn every agent (and tensor-parallel cluster scheduler); poll_start() follows them."""
        for group in self._tensor_parallel_groups():
            self._start_cluster(group)
        for agent in self.agents.values():
            self._spawn(agent)
        self._deadline = time.monotonic() + self.config.agents.startup_timeout_s

    def poll_start(self, timeout_s: float = POLL_S) -> bool:
        """Whether every agent is ready, after reading the reports that come within `timeout_s`.
        LaunchError when one failed or the start-up took too long (the rest keep running: stop())."""
        if all(a.ready for a in self.agents.values()):
            return True
        if time.monotonic() > self._deadline:
            waiting = [a.rank for a in self.agents.values() if not a.ready]
            raise LaunchError(f"agents {waiting} not ready after {self.config.agents.startup_timeout_s:.0f}s")
        self._take_reports(fail_on_error=True, timeout_s=timeout_s)
        return all(a.ready for a in self.agents.values())

    @property
    def pids(self) -> list[int]:
        """Every agent process (and cluster scheduler) this launcher holds."""
        processes = [a.process for a in self.agents.values()] + list(self.clusters.values())
        return [p.pid for p in processes if p is not None and p.pid is not None and p.is_alive()]

    def _tensor_parallel_groups(self) -> list[int]:
        agents = self.config.agents
        return sorted({agents.group_of_rank[r] for r in self.agents if agents.group(r).tensor_parallel > 1})

    def _spawn(self, agent: AgentHandle) -> None:
        agent.ready = False
        agents = self.config.agents
        group = agents.group_of_rank[agent.rank]
        env = self._device_env()
        if agents.groups[group].tensor_parallel > 1:
            env |= self._cluster_env(group, "MS_WORKER", agents.rank_in_group[agent.rank])
        with _environment(env):  # a spawned child starts with the parent's environment
            agent.process = self.ctx.Process(
                target=_agent_main,
                name=f"agent-{agent.rank}",
                args=(self.config, agent.rank, self.startup_queue, os.getpid()),
            )
            agent.process.start()
        self.log.info(
            "agent rank %d starting (pid %d, port %d, device %d)",
            agent.rank,
            agent.process.pid,
            agent.port,
            agents.device_id(agent.rank),
        )

    def _take_reports(self, fail_on_error: bool, timeout_s: float = POLL_S) -> None:
        """Read the readiness reports that come within `timeout_s`; notice agents that died before
        reporting."""
        while True:
            try:
                report = self.startup_queue.get(timeout=timeout_s)
            except queue.Empty:
                break
            timeout_s = 0  # then whatever else has come
            kind, rank = report[0], report[1]
            agent = self.agents[rank]
            if kind == "ready":
                _, _, port, pid, warm_up_s = report
                agent.ready = True
                line = (
                    f"agent rank {rank} ready on {self.config.agents.hosts[rank]}:{port} "
                    f"(pid {pid}, warm-up {warm_up_s:.1f}s, {self.config.agents.roles[rank]})"
                )
                self.log.info(line)
            else:
                self._start_failed(agent, report[2], fail_on_error)
        for agent in self.agents.values():
            if not agent.ready and agent.process is not None and not agent.process.is_alive():
                self._start_failed(
                    agent, f"exited with code {agent.process.exitcode} before it was ready", fail_on_error
                )

    def _start_failed(self, agent: AgentHandle, reason: str, fail_on_error: bool) -> None:
        message = f"agent rank {agent.rank} failed to start: {reason}\n{self._log_tail(agent.rank)}"
        if fail_on_error:
            raise LaunchError(message)
        self.log.error(message)
        agent.process = None  # counted as dead: the supervisor applies the restart policy

    def _log_tail(self, rank: int) -> str:
        path = self.config.logging.dir / agent_log_filename(rank)
        try:
            lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
        except OSError:
            return f"(no log at {path})"
        return f"last lines of {path}:\n" + "\n".join(lines[-LOG_TAIL_LINES:])

    # ---------------------------------------------------------------------------- supervision

    def mend(self, timeout_s: float = POLL_S) -> str | None:
        """One pass of supervision: the reports that come within `timeout_s`, and a restart of each
        dead agent the policy allows. Why not, for a death it does not allow (nothing stopped)."""
        policy = self.config.agents
        self._take_reports(fail_on_error=False, timeout_s=timeout_s)
        for agent in self.agents.values():
            if agent.process is not None and agent.process.is_alive():
                continue
            code = None if agent.process is None else agent.process.exitcode
            if policy.restart_policy == "restart" and agent.budget.take(time.monotonic()):
                self.log.warning(
                    "agent rank %d died (exit code %s); restarting (restart %d of %d within %gs)",
                    agent.rank,
                    code,
                    len(agent.budget.times),
                    policy.max_restarts,
                    policy.restart_window_s,
                )
                self._restart(agent)
            else:
                why = (
                    "restart policy is 'exit'"
                    if policy.restart_policy == "exit"
                    else f"{policy.max_restarts} restarts within {policy.restart_window_s:g}s used"
                )
                return f"agent rank {agent.rank} died (exit code {code}); {why}"
        return None

    def _restart(self, agent: AgentHandle) -> None:
        """Respawn a dead agent; in a tensor-parallel group, the whole group and its scheduler."""
        agents = self.config.agents
        group = agents.group_of_rank[agent.rank]
        if agents.groups[group].tensor_parallel == 1:
            self._spawn(agent)
            return
        members = [a for a in self.agents.values() if agents.group_of_rank[a.rank] == group]
        self._terminate([a.process for a in members if a.process is not None] + [self.clusters[group]])
        self._start_cluster(group)
        for member in members:
            self._spawn(member)

    def _terminate(self, processes: list) -> list[int]:
        """SIGTERM, SIGKILL after the grace period; the pids still alive after that."""
        alive = [p for p in processes if p.is_alive()]
        for process in alive:
            process.terminate()
        deadline = time.monotonic() + self.config.agents.shutdown_grace_s
        for process in alive:
            process.join(max(0.0, deadline - time.monotonic()))
        for process in alive:
            if process.is_alive():
                self.log.warning(
                    "agent pid %d ignored SIGTERM for %.0fs; killing it",
                    process.pid,
                    self.config.agents.shutdown_grace_s,
                )
                process.kill()
                process.join(5)
        return [p.pid for p in alive if p.is_alive()]

    def stop(self) -> bool:
        """SIGTERM every agent (each finishes its step in flight), SIGKILL what outlives the grace
        period. True when no agent process remains."""
        remaining = self._terminate([a.process for a in self.agents.values() if a.process is not None])
        # The cluster schedulers last: a worker that loses its scheduler first may wait for it.
        remaining += self._terminate(list(self.clusters.values()))
        if remaining:
            self.log.error("agent processes still alive after SIGKILL: %s", remaining)
        else:
            self.log.info("all agents stopped")
        return not remaining


@contextmanager
def _environment(values: dict[str, str]):
    """Set environment variables for the children started inside the block, then restore them."""
    saved = {key: os.environ.get(key) for key in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
