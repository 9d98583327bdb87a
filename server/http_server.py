"""Runs the app under uvicorn with the shutdown the product promises on SIGTERM/SIGINT:

1. stop admitting: new requests get 503 while the listening socket stays open;
2. let admitted requests finish, up to `server.drain_timeout_s`;
3. end what is left with a final event saying the server is shutting down;
4. then uvicorn closes the connections and the process exits 0.

A second signal during the drain skips the wait (uvicorn's own fast exit).
"""

from __future__ import annotations

import asyncio
import logging
import signal

import uvicorn
from sse_starlette.sse import AppStatus

from config.schema import ServingConfig, is_loopback
from server.output import OutputProcessor

log = logging.getLogger(__name__)

# After the drain every response has had its final event; this only bounds the socket close.
CLOSE_TIMEOUT_S = 5


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, outputs: OutputProcessor, drain_timeout_s: float):
        super().__init__(config)
        self.outputs = outputs
        self.drain_timeout_s = drain_timeout_s
        self._drain: asyncio.Task | None = None

    def handle_exit(self, sig: int, frame) -> None:
        if self._drain is not None or not self.started:
            super().handle_exit(sig, frame)
            return
        log.info("%s: refusing new requests, draining", signal.Signals(sig).name)
        self._captured_signals.append(sig)
        self._drain = asyncio.get_running_loop().create_task(self._drain_then_exit())

    async def _drain_then_exit(self) -> None:
        await self.outputs.drain(self.drain_timeout_s)
        AppStatus.should_exit = True  # lets sse-starlette close its streams now
        self.should_exit = True


def _log_signal(signum: int, _frame) -> None:
    log.info("stopped by %s", signal.Signals(signum).name)


def serve(config: ServingConfig, app, outputs: OutputProcessor) -> None:
    s = config.server
    log.info(
        "serving %s on http://%s:%d (%s); API keys %s",
        config.model.name,
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
    uv_config = uvicorn.Config(
        app,
        host=config.server.host,
        port=config.server.port,
        log_config=None,
        timeout_graceful_shutdown=CLOSE_TIMEOUT_S,
    )
    DrainingServer(uv_config, outputs, config.server.drain_timeout_s).run()
