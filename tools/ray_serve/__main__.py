"""Serve a config on Ray Serve: LLMServer replicas (each with its own agents) behind Ray Serve's HTTP
proxy on server.host:server.port, autoscaled on their load, routed by prompt prefix.

    python -m tools.ray_serve --config config/ray.yaml [--address HOST:PORT]

Without --address (or ray.address) a running Ray instance is joined where one is found
($RAY_ADDRESS, or one `ray start` began on this machine), else a local one is started. SIGTERM or
Ctrl-C stops the replicas (each drains, then stops its agents) and the Ray instance started here.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import time

from config import ConfigError, load_config
from config.logs import setup_logging

APP = "llm"
STATUS_POLL_S = 1.0


class Stop(Exception):
    """SIGTERM or SIGINT arrived."""


def _stop(signum: int, _frame) -> None:
    raise Stop(signal.Signals(signum).name)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", help="config file with a ray: section (default: $LLM_SERVING_CONFIG)")
    parser.add_argument("--address", help="a running Ray cluster to join (overrides ray.address)")
    args = parser.parse_args(argv)
    try:
        config = load_config(args.config)
        if config.ray is None:
            raise ConfigError("the config has no ray: section (config/ray.yaml has one)")
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    log = setup_logging(config.logging, "ray_serve.log", console=True, secrets=config.server.api_keys)
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, _stop)
    import ray
    from ray import serve

    from tools.ray_serve.app import build_app
    from tools.ray_serve.http_guard import proxy_environment

    address = args.address or config.ray.address
    s = config.server
    os.environ.update(proxy_environment(s))  # inherited by the Ray instance started here
    began = time.monotonic()
    started_ray = serving = False
    try:
        log.info(
            "Ray: %s", f"--address {address}" if address else "joining a running instance or starting one"
        )
        ray.init(address=address, include_dashboard=False, logging_level=logging.WARNING)
        for signum in (signal.SIGTERM, signal.SIGINT):  # ray.init put its own in place: ours again
            signal.signal(signum, _stop)
        node = ray._private.worker._global_node
        started_ray = node is not None and node.head  # a joined cluster's driver is no head: not ours
        log.info(
            "Ray %s at %s (%.1fs); starting the replicas (their agents compile the model's graphs)",
            "started" if started_ray else "joined",
            ray.get_runtime_context().gcs_address,
            time.monotonic() - began,
        )
        serve.start(http_options={"host": s.host, "port": s.port, "keep_alive_timeout_s": s.keep_alive_s})
        serving = True
        serve.run(build_app(config), name=APP, route_prefix="/", blocking=False)
        log.info(
            "serving on http://%s:%d after %.1fs: %d replica(s), autoscaled within %d..%d",
            s.host,
            s.port,
            time.monotonic() - began,
            _replicas(serve),
            config.ray.min_replicas,
            config.ray.max_replicas,
        )
        _watch(serve, log)
    except Stop as stop:
        log.info("%s: stopping the replicas", stop)
    except Exception as exc:  # Ray's and Serve's start-up errors: say which, stop what began
        log.error("Ray Serve failed: %s%s", exc, _replica_error(serve) if serving else "")
        return _shutdown(started_ray, serving, log, code=1)
    return _shutdown(started_ray, serving, log)


def _replicas(serve) -> int:
    """Running replicas of the LLMServer deployment."""
    status = serve.status().applications.get(APP)
    if status is None:
        return 0
    deployment = status.deployments.get("LLMServer")
    return 0 if deployment is None else deployment.replica_states.get("RUNNING", 0)


def _replica_error(serve) -> str:
    """The last line of the error a replica's start-up raised (the whole trace is in Ray's log)."""
    try:
        status = serve.status().applications.get(APP)
    except Exception as exc:  # the start-up error is logged all the same, and everything stopped
        return f" (and the replicas' state could not be read: {exc})"
    deployment = None if status is None else status.deployments.get("LLMServer")
    lines = [] if deployment is None else [s for s in deployment.message.splitlines() if s.strip()]
    return f" (a replica failed to start: {lines[-1].strip()})" if lines else ""


def _watch(serve, log: logging.Logger) -> None:
    """Log each change of the replica count, until a signal."""
    count, since = _replicas(serve), time.monotonic()
    while True:
        time.sleep(STATUS_POLL_S)
        now = _replicas(serve)
        if now != count:
            log.info("replicas: %d -> %d (after %.1fs at %d)", count, now, time.monotonic() - since, count)
            count, since = now, time.monotonic()


def _shutdown(started_ray: bool, serving: bool, log: logging.Logger, code: int = 0) -> int:
    """Every replica drains (up to ray.drain_timeout_s) and stops its agents; then the Ray instance
    started here stops (a joined one keeps running, less this application)."""
    import ray
    from ray import serve

    for signum in (signal.SIGTERM, signal.SIGINT):  # a second signal must not cut the drain
        signal.signal(signum, signal.SIG_IGN)
    try:
        if ray.is_initialized() and serving:
            if started_ray:
                serve.shutdown()
            else:
                serve.delete(APP)
    finally:
        if ray.is_initialized():
            ray.shutdown()
    log.info("stopped%s", " (and the Ray instance started here)" if started_ray else "")
    return code


if __name__ == "__main__":
    sys.exit(main())
