"""Prometheus metrics of one model's engine: its batch, slots and KV blocks, its agent calls, the
prefix cache and its tier, preemption and speculative decoding. They live in the model's registry
beside its answer streams' (server/metrics.py), so several apps and models share one process. Every
name starts with `llm_serving_`."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from agent.contract.step_reply import TierReport

STEP_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1, 2.5, 5)


class EngineMetrics:
    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        p = "llm_serving_"
        self.running = Gauge(p + "running_sequences", "Sequences in the running batch", registry=r)
        self.waiting = Gauge(p + "waiting_requests", "Requests waiting for a slot", registry=r)
        self.slots_used = Gauge(p + "slots_used", "KV-cache slots holding a sequence", registry=r)
        self.slots_total = Gauge(p + "slots", "KV-cache slots on healthy agents", registry=r)
        # Per group (group N: agents.groups[N], or the agent of port N in agents.ports).
        self.group_running = Gauge(
            p + "group_running_sequences", "Sequences in a group's batch", ["group"], registry=r
        )
        self.group_slots = Gauge(
            p + "group_slots", "KV-cache slots of a group while it is healthy", ["group"], registry=r
        )
        self.tokens_in_flight = Gauge(
            p + "tokens_in_flight",
            "Prompt + max_new_tokens of every admitted request (bounded by scheduler.max_tokens_in_flight)",
            registry=r,
        )
        self.prompt_tokens = Counter(p + "prompt_tokens", "Prompt tokens admitted", registry=r)
        self._agent_metrics(r, p)
        self._cache_metrics(r, p)
        self._tier_metrics(r, p)

    def _agent_metrics(self, r: CollectorRegistry, p: str) -> None:
        """Agent calls and KV transfers, as the server sees them."""
        self.agent_step = Histogram(
            p + "agent_step_seconds",
            "One agent call, as the server sees it",
            ["agent", "op"],
            buckets=STEP_BUCKETS,
            registry=r,
        )
        self.agent_compute = Histogram(
            p + "agent_compute_seconds",
            "One agent call's time inside the agent (its model work; agent_step minus this is the wire's)",
            ["agent", "op"],
            buckets=STEP_BUCKETS,
            registry=r,
        )
        self.kv_transfer_bytes = Counter(
            p + "kv_transfer_bytes",
            "K/V bytes sent from prefill to decode agents (PD disaggregation)",
            registry=r,
        )
        self.kv_transfer = Histogram(
            p + "kv_transfer_seconds",
            "One prompt's K/V from the prefill agent to the decode agent's acknowledgement",
            buckets=STEP_BUCKETS,
            registry=r,
        )
        self.agent_up = Gauge(p + "agent_up", "1 while the agent answers", ["agent"], registry=r)

    def _cache_metrics(self, r: CollectorRegistry, p: str) -> None:
        """The KV pool, the prefix cache, preemption and speculative decoding."""
        self.kv_blocks = Gauge(
            p + "kv_blocks",
            "KV-cache blocks of healthy groups: used (by sequences), free, cached (a prefix kept for reuse)",
            ["state"],
            registry=r,
        )
        self.prefix_cache_queries = Counter(
            p + "prefix_cache_queries", "Prompt tokens looked up in the prefix cache", registry=r
        )
        self.prefix_cache_hits = Counter(
            p + "prefix_cache_hits",
            "Prompt tokens found in the prefix cache (not computed again)",
            registry=r,
        )
        self.state_snapshots = Gauge(
            p + "state_snapshots",
            "Hybrid models' state snapshots of healthy groups (prefix-cache hits resume from them)",
            ["state"],
            registry=r,
        )
        self.state_restores = Counter(
            p + "state_restores",
            "Prefix-cache hits resumed from a state snapshot (hybrid models)",
            registry=r,
        )
        self.preemptions = Counter(
            p + "preemptions",
            "Sequences whose KV blocks were taken for others (recomputed later, nothing lost)",
            registry=r,
        )
        # Speculative decoding: accepted / proposed is the acceptance rate, accepted / steps the
        # tokens a verifying step gains.
        self.proposed_tokens = Counter(
            p + "spec_proposed_tokens", "Tokens proposed after decoding sequences' pending tokens", registry=r
        )
        self.accepted_tokens = Counter(
            p + "spec_accepted_tokens", "Proposed tokens the agents verified and kept", registry=r
        )
        self.speculative_steps = Counter(
            p + "spec_steps", "Decode steps of a sequence that verified proposals", registry=r
        )

    def _tier_metrics(self, r: CollectorRegistry, p: str) -> None:
        """The prefix cache's second tier (runtime.kv_tiers), as its agents report it."""
        self.prefix_cache_tier_hits = Counter(
            p + "prefix_cache_tier_hits",
            "Prompt tokens restored from the KV tier (host memory or disk; part of prefix_cache_hits)",
            registry=r,
        )
        self.kv_tier_hits = Counter(
            p + "kv_tier_hits", "KV blocks restored from the KV tier, by tier", ["tier"], registry=r
        )
        self.kv_tier_misses = Counter(
            p + "kv_tier_misses",
            "KV blocks a restore asked for that the tier no longer held (recomputed instead)",
            registry=r,
        )
        self.kv_tier_bytes = Gauge(
            p + "kv_tier_bytes", "Bytes the KV tier holds, by tier and group", ["tier", "group"], registry=r
        )
        self.kv_tier_restore = Histogram(
            p + "kv_tier_restore_seconds",
            "One agent step's restores out of the KV tier (before its compute)",
            buckets=STEP_BUCKETS,
            registry=r,
        )
        self.kv_tier_disk_writes = Counter(
            p + "kv_tier_disk_writes", "KV blocks written to the disk tier", registry=r
        )
        self.kv_tier_disk_evictions = Counter(
            p + "kv_tier_disk_evictions", "KV block files removed for room in the disk tier", registry=r
        )
        self.kv_tier_dropped_writes = Counter(
            p + "kv_tier_dropped_writes",
            "KV blocks not written to disk because the write queue was full (the step never waits)",
            registry=r,
        )
        self.kv_tier_ignored_files = Counter(
            p + "kv_tier_ignored_files",
            "KV tier files ignored: truncated, corrupt, another model's or another layout's",
            registry=r,
        )
        for tier in ("host", "disk"):
            self.kv_tier_hits.labels(tier)

    def count_tier(self, group: int, report: TierReport) -> None:
        """One agent's tier report (a step reply's or a drop's)."""
        counts = report.counts
        self.kv_tier_hits.labels("host").inc(counts["host_hits"])
        self.kv_tier_hits.labels("disk").inc(counts["disk_hits"])
        for counter, name in (
            (self.kv_tier_misses, "misses"),
            (self.kv_tier_disk_writes, "written"),
            (self.kv_tier_disk_evictions, "evicted"),
            (self.kv_tier_dropped_writes, "dropped_writes"),
            (self.kv_tier_ignored_files, "ignored_files"),
        ):
            counter.inc(counts[name])
        self.kv_tier_bytes.labels("host", str(group)).set(report.host_bytes)
        self.kv_tier_bytes.labels("disk", str(group)).set(report.disk_bytes)
        if counts["host_hits"] + counts["disk_hits"] + counts["misses"]:
            self.kv_tier_restore.observe(report.restore_s)
