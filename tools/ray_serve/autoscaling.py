"""The replica count from the load the server already measures: waiting + running requests (what
/serving/get_request_numbers and /serving/get_bs give), summed over the replicas, plus the requests
Ray Serve holds at the proxy because every replica is full, divided by ray.target_load_per_replica.

Why not Ray Serve's built-in target_ongoing_requests: it counts a request from the moment a replica
takes it until the last byte left, tokenizing and streaming out included, and it cannot tell a
replica whose batch is full (waiting requests) from one with free slots. The engine's own figures
are the ones operators watch and alert on; the autoscaler follows the same. Ray's wrapper around a
custom policy still applies min/max_replicas and the upscale/downscale delays.
"""

from __future__ import annotations

from ray.serve.config import AutoscalingContext


def replica_load(ctx: AutoscalingContext) -> tuple[float, dict]:
    metrics = ctx.aggregated_metrics or {}
    running, waiting = metrics.get("running"), metrics.get("waiting")
    if not running or waiting is None:  # no replica has reported yet: keep the count
        return ctx.target_num_replicas, {}
    load = sum(running.values()) + sum(waiting.values()) + (ctx.total_queued_requests or 0)
    assert ctx.config is not None  # Ray passes the deployment's autoscaling config
    return load / ctx.config.get_target_ongoing_requests(), {}
