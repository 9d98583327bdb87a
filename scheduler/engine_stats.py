"""EngineStats: what an engine is doing at one moment, per group (vLLM's SchedulerStats), frozen. The
one source of /info, /serving/get_bs and /serving/get_queue, the Prometheus gauges and the dashboard
(which reads /info and /metrics). BatchScheduler.stats builds it; Engine.stats adds nothing but the
state before the groups connect."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

BlockState = Literal["used", "free", "cached"]


@dataclass(frozen=True, kw_only=True)
class KvBlockStats:
    """A group's KV block pool: used (held by sequences), free (unused, or cached with no holder),
    cached (holding a prefix for reuse)."""

    block_size: int
    total: int
    used: int
    free: int
    cached: int
    prefix_caching: bool


@dataclass(frozen=True, kw_only=True)
class StateStats:
    """A hybrid model's group (Gated DeltaNet layers): each running sequence holds a state in its
    slot; snapshots of prompts' states are kept for prefix-cache hits (scheduler/state_snapshots.py)."""

    snapshots: int  # slots for them
    held: int  # registered (hit-able)


@dataclass(frozen=True, kw_only=True)
class GroupStats:
    """One agent group: its agents, role and limits (zero before it connects), its health, the
    sequences it runs, the slot releases its agent has not answered yet (planned or not yet
    planned: 0 when every freed slot is free there) and its KV pool (None before it connects)."""

    group: int
    agents: tuple[str, ...]
    role: str
    healthy: bool = False
    usable_slots: int = 0  # the slots the scheduler fills (GroupCapacity.usable_slots)
    max_prompt_len: int = 0
    max_seq_len: int = 0
    running: int = 0
    releases_pending: int = 0
    kv_blocks: KvBlockStats | None = None
    states: StateStats | None = None  # a hybrid model's group that keeps state snapshots

    @property
    def decodes(self) -> bool:
        return self.role != "prefill"

    @property
    def slots(self) -> int:
        """KV slots while the group is healthy, else 0."""
        return self.usable_slots if self.healthy else 0


@dataclass(frozen=True, kw_only=True)
class EngineCounts:
    """Totals since the engine started (the metrics' counters): sequences preempted; prompt tokens
    looked up in the prefix cache and found there (in the pool, or in its second tier); tokens
    proposed (speculative decoding), kept, and the decode steps that verified proposals."""

    preemptions: int = 0
    prefix_query_tokens: int = 0
    prefix_hit_tokens: int = 0
    prefix_tier_hit_tokens: int = 0
    state_restores: int = 0  # prefix-cache hits resumed from a state snapshot (hybrid models)
    proposed_tokens: int = 0
    accepted_tokens: int = 0
    speculative_steps: int = 0


@dataclass(frozen=True, kw_only=True)
class EngineStats:
    started: bool  # connected to every group, the loop running
    running: int = 0
    waiting: int = 0
    tokens_in_flight: int = 0  # prompt + answer tokens of every admitted request
    groups: tuple[GroupStats, ...] = ()
    counts: EngineCounts = EngineCounts()

    @property
    def usable_slots(self) -> int:
        """Decode slots of every group, healthy or not."""
        return sum(g.usable_slots for g in self.groups if g.decodes)

    @property
    def slots(self) -> int:
        """Decode slots of the healthy groups."""
        return sum(g.slots for g in self.groups if g.decodes)

    def state_snapshots(self, held: bool) -> int:
        """State snapshots of the healthy groups: held (hit-able), else free."""
        return sum(
            g.states.held if held else g.states.snapshots - g.states.held
            for g in self.groups
            if g.healthy and g.states
        )

    def kv_blocks(self, state: BlockState) -> int:
        """KV blocks in `state` of the healthy groups."""
        return sum(getattr(g.kv_blocks, state) for g in self.groups if g.healthy and g.kv_blocks)
