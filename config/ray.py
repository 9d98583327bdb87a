"""Scaling out on Ray Serve (python -m tools.ray_serve)."""

from __future__ import annotations

from pydantic import Field, model_validator

from config.base import Section


class RaySection(Section):
    """Scaling out on Ray Serve (`python -m tools.ray_serve`): each replica is one LLMServer with
    its own agents on its node; the replica count follows the load between min and max."""

    address: str | None = Field(
        None, description="a running Ray cluster to join (ray://... or HOST:PORT); none: a local instance"
    )
    min_replicas: int = Field(1, ge=1, description="replicas kept even when idle")
    max_replicas: int = Field(2, ge=1, description="replicas the load may add up to")
    initial_replicas: int | None = Field(None, ge=1, description="replicas at start; none: min_replicas")
    target_load_per_replica: float = Field(
        4.0,
        gt=0,
        description="waiting + running requests per replica the autoscaler aims at (the figures "
        "/serving/get_request_numbers and /serving/get_bs give, summed over the replicas)",
    )
    upscale_delay_s: float = Field(5.0, ge=0, description="load above target this long adds replicas")
    downscale_delay_s: float = Field(30.0, ge=0, description="load below target this long removes replicas")
    metrics_interval_s: float = Field(1.0, gt=0, description="how often each replica reports its load")
    look_back_period_s: float = Field(5.0, gt=0, description="the load is averaged over this window")
    drain_timeout_s: float = Field(
        30.0, gt=0, description="a replica being removed finishes its streams within this, then stops"
    )
    max_ongoing_requests: int = Field(
        64, ge=1, description="requests Ray Serve sends one replica at once (queued beyond: at the proxy)"
    )
    num_cpus: float = Field(1.0, ge=0, description="Ray CPUs each replica reserves")
    resources: dict[str, float] = Field(
        default_factory=dict,
        description="other Ray resources per replica, e.g. {NPU: 1} on Ascend (one per agent port)",
    )
    health_check_period_s: float = Field(2.0, gt=0, description="how often Ray asks a replica /ready")
    health_check_timeout_s: float = Field(10.0, gt=0, description="a health check slower than this fails")
    prefix_block_chars: int = Field(
        64, ge=1, description="prefix routing: characters of one prompt block (about block_size tokens)"
    )
    prefix_blocks: int = Field(
        8, ge=1, description="prefix routing: the first blocks of a prompt hashed to find its replica"
    )
    prefix_imbalance: int = Field(
        8,
        ge=0,
        description="prefix routing: the replica holding a prefix is passed over when it has this "
        "many more requests than the least loaded one",
    )

    @model_validator(mode="after")
    def _bounds(self) -> RaySection:
        if self.min_replicas > self.max_replicas:
            raise ValueError(f"min_replicas ({self.min_replicas}) exceeds max_replicas ({self.max_replicas})")
        initial = self.initial_replicas
        if initial is not None and not self.min_replicas <= initial <= self.max_replicas:
            raise ValueError(
                f"initial_replicas ({initial}) must lie within min_replicas..max_replicas "
                f"({self.min_replicas}..{self.max_replicas})"
            )
        return self
