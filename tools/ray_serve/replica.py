"""One replica of the Ray Serve application: one LLMServer (the server assembly: server/app.py's
routes over its ModelRepository and engine) with its own agents, started here on the replica's node
by the agent launcher, on ports the OS picks (two replicas on one machine never collide).

Requests arrive from the proxy (tools/ray_serve/proxy.py) as the HTTP request's parts and run
through the same ASGI app as `start_server.py` serves: the answer's status, headers and body chunks
stream back unchanged. Ray Serve calls `check_health` (the server's /ready, and the launcher's
supervision), `record_autoscaling_stats` (waiting and running requests) and, when it removes the
replica, waits for its requests up to ray.drain_timeout_s, then `__del__` ends what is left with
the final event a SIGTERM gives and stops the agents.

A dead agent is not restarted here (restart_policy exit): the replica turns unhealthy and Ray Serve
replaces the whole replica, while the other replicas take the new requests.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
from collections.abc import AsyncIterator

from ray import serve

from agent.model.tokenizer import load_tokenizer
from agent.process_env import set_process_defaults
from config.logs import setup_logging
from config.schema import ServingConfig
from server.app import create_app
from server.model_repository import ModelRepository

log = logging.getLogger("ray_replica")
# After the client has gone, how long the app may take to close the request's streams.
CLOSE_AFTER_DISCONNECT_S = 5.0
# What is still streaming when __del__ runs (after Ray's own wait) gets this long to end.
FINAL_DRAIN_S = 1.0


def free_ports(count: int, host: str) -> list[int]:
    """Ports the OS has free on `host` now (all held open together, so they differ)."""
    sockets = [socket.socket() for _ in range(count)]
    try:
        for s in sockets:
            s.bind((host, 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def replica_config(config: ServingConfig, replica: str, npus: list[str]) -> ServingConfig:
    """The config of one replica: its own agent ports (and cluster ports), logs in
    {logging.dir}/ray/{replica}/, dead agents left to Ray (restart_policy exit); with NPUs from
    Ray, devices from 0 (Ray limits the replica's visible devices to its own)."""
    data = config.model_dump(mode="json")
    agents = data["agents"]
    cluster_groups = [g for g in agents["groups"] if g.get("cluster_port") is not None]
    ports = iter(free_ports(len(config.agents.ports) + len(cluster_groups), config.agents.host))
    for group in agents["groups"]:
        group["ports"] = [next(ports) for _ in group["ports"]]
    for group in cluster_groups:
        group["cluster_port"] = next(ports)
    agents["ports"] = [p for g in agents["groups"] for p in g["ports"]]
    agents["restart_policy"] = "exit"
    if npus:
        agents["start_device_id"] = 0
    data["logging"]["dir"] = str(config.logging.dir / "ray" / replica)
    return ServingConfig.model_validate(data)


class ReplicaAgents:
    """The replica's agents: the launcher's models started and supervised in a thread (signals
    belong to Ray's worker, so the stop is a flag)."""

    def __init__(self, config: ServingConfig):
        from agent.launcher.models import LaunchedModels  # the launcher, not the agent runtime

        self.models = LaunchedModels(config)
        self.failure: str | None = None
        self.thread: threading.Thread | None = None

    def start(self) -> None:
        """Blocks until every agent is ready (LaunchError, all stopped, when one fails)."""
        self.models.start()
        self.thread = threading.Thread(target=self._supervise, name="agent-supervisor", daemon=True)
        self.thread.start()

    def _supervise(self) -> None:
        if self.models.supervise() != 0 and self.models.stop_signal is None:
            self.failure = "an agent died: the replica's agents were stopped (Ray replaces the replica)"
            log.error("%s", self.failure)

    def stop(self) -> None:
        self.models.stop_signal = 15  # SIGTERM's number: supervise() stops every agent
        if self.thread is not None:
            self.thread.join()
        else:
            self.models.stop()


class LLMServerReplica:
    async def __init__(self, config: ServingConfig):  # type: ignore[misc]  # Ray Serve awaits it
        set_process_defaults()  # before the agents spawn (they inherit it), on any node
        import ray

        self.replica_id = serve.get_replica_context().replica_id.unique_id
        npus = ray.get_runtime_context().get_accelerator_ids().get("NPU", [])
        self.config = replica_config(config, self.replica_id, npus)
        setup_logging(self.config.logging, "server_app.log", secrets=self.config.server.api_keys)
        log.info("replica %s: starting agents on ports %s", self.replica_id, self.config.agents.ports)
        self.agents = ReplicaAgents(self.config)
        await asyncio.to_thread(self.agents.start)
        tokenizers = {name: load_tokenizer(c.model.path) for name, c in self.config.model_configs().items()}
        self.repository = ModelRepository(self.config, tokenizers)
        self.app = create_app(self.config, self.repository)
        await self.repository.start()
        log.info("replica %s: serving", self.replica_id)

    async def unique_id(self) -> str:
        return self.replica_id

    async def check_health(self) -> None:
        """Ray Serve's health check: the launcher's supervision, then the server's /ready."""
        if self.agents.failure is not None:
            raise RuntimeError(self.agents.failure)
        reason = await self.repository.readiness()
        if reason:
            raise RuntimeError(f"not ready: {reason}")

    async def record_autoscaling_stats(self) -> dict[str, float]:
        """The load the autoscaling policy reads (tools/ray_serve/autoscaling.py)."""
        engines = self.repository.engines(None)
        return {
            "running": float(sum(e.stats().running for e in engines)),
            "waiting": float(sum(e.stats().waiting for e in engines)),
        }

    async def handle_http(
        self,
        request: dict,
        prefix: list[str] | None = None,
        replica: str | None = None,
        avoid: str | None = None,
    ) -> AsyncIterator:
        """The app's answer to one HTTP request: first {"status", "headers", "replica": this
        replica's id}, then the body's chunks as the app sends them. `prefix`, `replica` and
        `avoid` are read by the router only."""
        async for item in call_app(self.app, request):
            yield {**item, "replica": self.replica_id} if isinstance(item, dict) else item

    async def __del__(self) -> None:
        """Ray Serve removes the replica (scale-down, replacement, shutdown) after waiting for its
        requests: end what is left with the shutdown event, then stop the engine and the agents."""
        repository, agents = getattr(self, "repository", None), getattr(self, "agents", None)
        if repository is not None:  # not after a start-up that failed before it
            await repository.drain(FINAL_DRAIN_S)
            await repository.stop()
        if agents is not None:
            await asyncio.to_thread(agents.stop)
        log.info("replica %s: stopped", getattr(self, "replica_id", "?"))


async def call_app(app, request: dict) -> AsyncIterator:
    """Run one request through an ASGI app: the request's body at the first receive(), a
    disconnect once the caller stops reading (the app then aborts the request's generation)."""
    messages: asyncio.Queue = asyncio.Queue()
    gone = asyncio.Event()
    body_sent = False

    async def receive() -> dict:
        nonlocal body_sent
        if not body_sent:
            body_sent = True
            return {"type": "http.request", "body": request["body"], "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        await messages.put(message)

    scope = {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": request["method"],
        "scheme": "http",
        "path": request["path"],
        "raw_path": request["path"].encode(),
        "query_string": request["query_string"],
        "root_path": "",
        "headers": request["headers"],
        "client": request.get("client"),
        "server": request.get("server"),
        "state": {},
    }
    running = asyncio.create_task(app(scope, receive, send))
    running.add_done_callback(lambda _: messages.put_nowait(None))
    started = False
    try:
        while (message := await messages.get()) is not None:
            if message["type"] == "http.response.start":
                started = True
                yield {"status": message["status"], "headers": list(message.get("headers", []))}
            elif message["type"] == "http.response.body":
                if message.get("body"):
                    yield bytes(message["body"])
                if not message.get("more_body", False):
                    return
        if not started:  # the app failed before it answered (its error handler answers 500 first)
            failure = running.exception() if not running.cancelled() else None
            log.error("request %s %s failed: %r", request["method"], request["path"], failure)
            yield {"status": 500, "headers": [(b"content-type", b"application/json")]}
            yield b'{"error": "internal error"}'
    finally:
        gone.set()
        if not running.done():  # give the app its time to close the streams, then cut it off
            asyncio.get_running_loop().call_later(CLOSE_AFTER_DISCONNECT_S, running.cancel)
