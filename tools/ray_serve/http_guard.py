"""Ray Serve's HTTP proxy with the plain server's bound on request heads: a head must arrive within
server.read_timeout_s (server/client_deadlines.py), where Ray's uvicorn bounds none (a client that
trickles a header a byte at a time held a connection for ever).

Ray Serve calls RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH in its HTTP proxy's process before that
proxy starts its uvicorn server (its hook for middlewares): `guard_heads` makes uvicorn's default
protocol SlowClientGuard there. tools.ray_serve puts `proxy_environment` into the environment of the
Ray instance it starts; a cluster started elsewhere needs both variables in its nodes' environment.
"""

from __future__ import annotations

import os

from config.schema import ServerSection

CALLBACK_ENV = "RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH"
HEAD_TIMEOUT_ENV = "LLM_SERVING_HEAD_TIMEOUT_S"


def proxy_environment(server: ServerSection) -> dict[str, str]:
    return {CALLBACK_ENV: f"{__name__}:guard_heads", HEAD_TIMEOUT_ENV: f"{server.read_timeout_s:g}"}


def guard_heads() -> list:
    """In Ray Serve's HTTP proxy: its uvicorn server will speak SlowClientGuard. No middleware."""
    from uvicorn import config

    from server.client_deadlines import SlowClientGuard

    SlowClientGuard.head_timeout_s = float(os.environ[HEAD_TIMEOUT_ENV])
    config.HTTP_PROTOCOLS["auto"] = "server.client_deadlines:SlowClientGuard"
    return []
