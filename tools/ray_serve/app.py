"""The Ray Serve application of a config with a `ray:` section: the LLMServer replicas (autoscaled,
prefix-routed, health-checked) behind the proxy deployment that Ray Serve's HTTP proxy calls.

    serve run tools.ray_serve.app:app_from_env     (the config from $LLM_SERVING_CONFIG)
"""

from __future__ import annotations

from ray import serve
from ray.serve import Application

from config import load_config
from config.schema import RaySection, ServingConfig
from tools.ray_serve.proxy import REPLICA_DEPLOYMENT, ServingProxy
from tools.ray_serve.replica import LLMServerReplica

POLICY = "tools.ray_serve.autoscaling:replica_load"
ROUTER = "tools.ray_serve.routing.PrefixAffinityRouter"


def autoscaling_config(ray: RaySection) -> dict:
    return {
        "min_replicas": ray.min_replicas,
        "max_replicas": ray.max_replicas,
        "initial_replicas": ray.initial_replicas or ray.min_replicas,
        "target_ongoing_requests": ray.target_load_per_replica,  # the policy's target load
        "upscale_delay_s": ray.upscale_delay_s,
        "downscale_delay_s": ray.downscale_delay_s,
        "metrics_interval_s": ray.metrics_interval_s,
        "look_back_period_s": ray.look_back_period_s,
        "policy": {"policy_function": POLICY},
    }


def build_app(config: ServingConfig) -> Application:
    ray = config.ray
    if ray is None:
        raise ValueError("the config has no ray: section (config/ray.yaml has one)")
    replicas = serve.deployment(
        name=REPLICA_DEPLOYMENT,
        autoscaling_config=autoscaling_config(ray),
        max_ongoing_requests=ray.max_ongoing_requests,
        graceful_shutdown_timeout_s=ray.drain_timeout_s,
        graceful_shutdown_wait_loop_s=0.5,
        health_check_period_s=ray.health_check_period_s,
        health_check_timeout_s=ray.health_check_timeout_s,
        ray_actor_options={"num_cpus": ray.num_cpus, "resources": dict(ray.resources)},
        request_router_config={
            "request_router_class": ROUTER,
            "request_router_kwargs": {"imbalance": ray.prefix_imbalance},
        },
    )(LLMServerReplica)
    proxy = serve.deployment(
        name="ServingProxy",
        num_replicas=1,
        max_ongoing_requests=config.server.max_connections,
        ray_actor_options={"num_cpus": 0},
    )(ServingProxy)
    return proxy.bind(replicas.bind(config), ray, config.server)


def app_from_env(args: dict | None = None) -> Application:
    """For `serve run tools.ray_serve.app:app_from_env [config=PATH]`."""
    return build_app(load_config((args or {}).get("config")))
