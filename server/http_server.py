"""Runs the app under uvicorn with the shutdown the product promises on SIGTERM/SIGINT:

1. stop admitting: new requests get 503 while the listening socket stays open;
2. let admitted requests finish, up to `server.drain_timeout_s`;
3. end what is left with a final event saying the server is shutting down;
4. then uvicorn closes the connections and the process exits 0.

A second signal during the drain skips the wait (uvicorn's own fast exit). A signal while the
server still waits for its agents (before it listens) ends the wait at once: exit 0. If the
engine's loop dies, the open requests get their error, then the process exits 1 so that a
supervisor restarts it. Slow clients are bounded by `SlowClientGuard` (server/client_deadlines.py).
With `server.grpc_port`, the KServe v2 gRPC server (server/grpc_server.py) listens beside HTTP on
the same loop from the same start, and stops with it.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import signal
import time
from typing import TYPE_CHECKING

import uvicorn
from sse_starlette.sse import AppStatus

from config.schema import ServingConfig, is_loopback
from scheduler.agent_client import AgentError
from server.client_deadlines import SlowClientGuard
from server.model_repository import ModelRepository

if TYPE_CHECKING:
    import grpc

log = logging.getLogger(__name__)

# After the drain every response has had its final event; this only bounds the socket close.
CLOSE_TIMEOUT_S = 5
EXIT_OK, EXIT_ENGINE_DEAD, EXIT_NO_AGENTS = 0, 1, 3  # 3: uvicorn's own "startup failed"
EXIT_NO_PORT = 2  # the gRPC port cannot be listened on: a configuration error


class DrainingServer(uvicorn.Server):
    def __init__(
        self,
        config: uvicorn.Config,
        repository: ModelRepository,
        drain_timeout_s: float,
        serving: ServingConfig | None = None,
    ):
        super().__init__(config)
        self.repository = repository
        self.drain_timeout_s = drain_timeout_s
        self.serving = serving  # with server.grpc_port: the gRPC server starts beside HTTP
        self.grpc: grpc.aio.Server | None = None  # that server, while it runs
        self.exit_code = EXIT_OK
        self._drain: asyncio.Task | None = None
        self._agents_wait: asyncio.Task | None = None
        self._engine_watch: asyncio.Task | None = None

    async def startup(self, sockets=None) -> None:
        """Connect to the startup models' agents first (up to server.agent_wait_s), in a task a
        signal can cancel: uvicorn would only look at its exit flag once the app's startup is over."""
        self._agents_wait = asyncio.create_task(self.repository.start())
        try:
            await self._agents_wait
        except asyncio.CancelledError:
            if not self.should_exit:
                raise
            log.info("stopped while waiting for the agents")
            await self.repository.stop()
            return
        except AgentError as exc:
            log.error("%s", exc)
            self.exit_code, self.should_exit = EXIT_NO_AGENTS, True
            await self.repository.stop()
            return
        if self.serving is not None and self.serving.server.grpc_port is not None:
            from server.grpc_server import start_grpc  # grpcio only where it is asked for

            try:
                self.grpc = await start_grpc(self.serving, self.repository)
            except OSError as exc:
                log.error("%s", exc)
                self.exit_code, self.should_exit = EXIT_NO_PORT, True
                await self.repository.stop()
                return
        await super().startup(sockets)
        # What start-up built lives as long as the server: out of the cyclic collector's full passes,
        # which otherwise walk all of it while every stream waits (measured: client-side ITL p99).
        gc.freeze()
        self._engine_watch = asyncio.create_task(self._exit_when_engine_dies())

    def handle_exit(self, sig: int, frame) -> None:
        if not self.started and self._agents_wait is not None and not self._agents_wait.done():
            super().handle_exit(sig, frame)
            # Called between bytecodes of the loop's thread: wake the loop's select() too.
            self._agents_wait.get_loop().call_soon_threadsafe(self._agents_wait.cancel)
            return
        if self._drain is not None or not self.started:
            super().handle_exit(sig, frame)
            return
        log.info("%s: refusing new requests, draining", signal.Signals(sig).name)
        self._captured_signals.append(sig)
        self._drain = asyncio.get_running_loop().create_task(self._drain_then_exit())

    async def _drain_then_exit(self) -> None:
        await self.repository.drain(self.drain_timeout_s)
        AppStatus.should_exit = True  # lets sse-starlette close its streams now
        self.should_exit = True

    async def _exit_when_engine_dies(self) -> None:
        """A dead scheduler loop (of any model) serves nothing again: once its open requests have
        had their error (bounded by CLOSE_TIMEOUT_S), exit non-zero so that a supervisor starts a
        fresh server."""
        repository = self.repository
        await repository.dead.wait()
        log.error(
            "exiting with code %d so that a supervisor restarts the server: %s",
            EXIT_ENGINE_DEAD,
            repository.failure,
        )
        self.exit_code = EXIT_ENGINE_DEAD
        repository.refuse_new_requests()
        deadline = time.monotonic() + CLOSE_TIMEOUT_S
        while repository.open_streams() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        AppStatus.should_exit = True
        self.should_exit = True

    async def shutdown(self, sockets=None) -> None:
        if self._engine_watch is not None:
            self._engine_watch.cancel()
        if self.grpc is not None:  # after the drain: its calls have had their answers or errors
            await self.grpc.stop(CLOSE_TIMEOUT_S)
        await super().shutdown(sockets)


def _log_signal(signum: int, _frame) -> None:
    log.info("stopped by %s", signal.Signals(signum).name)


def serve(config: ServingConfig, app, repository: ModelRepository) -> int:
    """Serves until SIGTERM/SIGINT (exit code 0) or a dead engine (1); 3 if the agents never answered."""
    s = config.server
    log.info(
        "serving %s on http://%s:%d (%s); API keys %s",
        ", ".join(repository.models),
        s.host,
        s.port,
        "this machine only" if is_loopback(s.host) else "reachable from other machines",
        "required" if s.api_keys else "off",
    )
    # uvicorn re-raises the signal it caught under the handler it found: one that only logs makes
    # that a clean exit 0.
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, _log_signal)
    # sse-starlette would otherwise cut every stream the moment the signal arrives, without a final event.
    AppStatus.disable_automatic_graceful_drain()
    SlowClientGuard.head_timeout_s = s.read_timeout_s
    uv_config = uvicorn.Config(
        app,
        host=s.host,
        port=s.port,
        log_config=None,
        http=SlowClientGuard,
        limit_concurrency=s.max_connections,
        timeout_keep_alive=s.keep_alive_s,
        timeout_graceful_shutdown=CLOSE_TIMEOUT_S,
    )
    server = DrainingServer(uv_config, repository, s.drain_timeout_s, config)
    server.run()
    return server.exit_code
