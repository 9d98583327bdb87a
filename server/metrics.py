"""Prometheus metrics of the answer streams, and the exposition of every served model's metrics.

StreamMetrics: what the clients of one model see (tokens, time to first token, between tokens, to
the end; each request's outcome, refusals at admission among them). ModelMetrics: one model's
registry, holding its engine's (scheduler/metrics.py) and its streams'. MetricsByModel: every
model's in one exposition (/metrics), each sample labelled with its model. Every name starts with
`llm_serving_`."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.metrics_core import Metric

from scheduler.metrics import STEP_BUCKETS, EngineMetrics

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
OUTCOMES = ("ok", "aborted", "rejected", "error")


class StreamMetrics:
    def __init__(self, registry: CollectorRegistry | None = None):
        r = registry if registry is not None else CollectorRegistry()
        p = "llm_serving_"
        self.open_streams = Gauge(
            p + "open_streams",
            "Answer streams their clients have not yet finished reading or closed",
            registry=r,
        )
        self.requests = Counter(p + "requests", "Finished requests by outcome", ["outcome"], registry=r)
        for outcome in OUTCOMES:
            self.requests.labels(outcome)
        self.generated_tokens = Counter(p + "generated_tokens", "Tokens generated", registry=r)
        self.ttft = Histogram(
            p + "time_to_first_token_seconds", "Admission to first token", buckets=LATENCY_BUCKETS, registry=r
        )
        self.inter_token = Histogram(
            p + "inter_token_latency_seconds", "Between a stream's tokens", buckets=STEP_BUCKETS, registry=r
        )
        self.e2e = Histogram(
            p + "request_duration_seconds", "Admission to the last token", buckets=LATENCY_BUCKETS, registry=r
        )


class ModelMetrics:
    """One served model's metrics: its engine's and its answer streams', in one registry."""

    def __init__(self):
        self.registry = CollectorRegistry()
        self.engine = EngineMetrics(self.registry)
        self.streams = StreamMetrics(self.registry)


class MetricsByModel:
    """Every served model's metrics (each model's ModelMetrics) in one exposition, each sample
    labelled with its model: `registry` is what /metrics writes. An unloaded model's go with it."""

    def __init__(self):
        self.registry = CollectorRegistry(auto_describe=False)
        self.models: dict[str, ModelMetrics] = {}
        self.registry.register(self)  # a collector: collect() below

    def collect(self) -> Iterator[Metric]:
        families: dict[str, Metric] = {}
        for model, metrics in list(self.models.items()):
            for family in metrics.registry.collect():
                merged = families.setdefault(
                    family.name, Metric(family.name, family.documentation, family.type, family.unit)
                )
                merged.samples += [s._replace(labels={**s.labels, "model": model}) for s in family.samples]
        return iter(families.values())
