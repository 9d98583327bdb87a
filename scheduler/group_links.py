"""GroupLinks: the engine's connections to its agent groups. Connecting (with the start-up wait),
the compatibility check and this server's session, the readiness pings, probing a failed group
until it is back, and the groups another server took over (never reclaimed: the newer server wins).
The engine (scheduler/engine.py) decides what a failure means for the requests."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from agent.contract.step import MAX_DRAFT_TOKENS
from agent.contract.transport import ClientKeys
from config.schema import ServingConfig
from scheduler.agent_client import (
    AgentClient,
    AgentError,
    AgentIncompatible,
    AgentTakenOver,
    AgentUnavailable,
    GroupClient,
    ModelClient,
)
from scheduler.plan import GroupCapacity

log = logging.getLogger(__name__)

RECOVERY_PROBE_S = 2.0  # a failed group is asked for `info` with this timeout ...
RECOVERY_INTERVAL_S = 1.0  # ... this long apart, until it answers (the launcher restarted it)


class GroupLinks:
    def __init__(self, config: ServingConfig, vocab_size: int):
        self.config = config
        self.vocab_size = vocab_size  # the tokenizer's: every group must cover it
        self.epoch = time.time_ns()  # this server's start: agents let only a newer server take them over
        self.clients = [self._group_client(group) for group in range(len(config.agents.groups))]
        self.eos_ids: set[int] = set()  # the groups' own, learnt at connection
        self.taken_over: set[int] = set()  # groups another server took over: never reclaimed

    def _group_client(self, group: int) -> ModelClient:
        agents = self.config.agents
        clients = [
            AgentClient(
                agents.address(rank), self.config.server.agent_timeout_s, self._keys(rank), epoch=self.epoch
            )
            for rank, g in enumerate(agents.group_of_rank)
            if g == group
        ]
        return clients[0] if len(clients) == 1 else GroupClient(clients)

    def _keys(self, rank: int) -> ClientKeys | None:
        curve = self.config.agents.curve
        if curve is None:
            return None
        return ClientKeys(*curve.server_keypair(), agent_public_key=curve.agents[rank].public_key)

    async def connect_all(self) -> list[GroupCapacity]:
        """Every group, waiting up to server.agent_wait_s for each."""
        return [await self._wait_for_group(group) for group in range(len(self.clients))]

    async def _wait_for_group(self, group: int) -> GroupCapacity:
        client = self.clients[group]
        deadline = time.monotonic() + self.config.server.agent_wait_s
        while True:
            try:
                return await self.connect(group)
            except AgentUnavailable as exc:
                if time.monotonic() > deadline:
                    raise AgentError(
                        f"agent {client.address} not answering after "
                        f"{self.config.server.agent_wait_s:g}s: {exc}"
                    ) from exc
                log.info("waiting for agent %s (%s)", client.address, exc)
                if client.lost:
                    client.reconnect()

    async def connect(self, group: int, timeout_s: float | None = None) -> GroupCapacity:
        """Check the group serves our model, then open this server's session on it (every slot
        released: this server owns them all)."""
        client = self.clients[group]
        info = await client.info(timeout_s)
        if info["vocab_size"] < self.vocab_size:
            raise AgentIncompatible(
                f"agent {client.address} serves a vocabulary of {info['vocab_size']} "
                f"tokens; the tokenizer has {self.vocab_size}"
            )
        role = self.config.agents.groups[group].role
        if info.get("role") != role:
            raise AgentIncompatible(
                f"agent {client.address} runs as a {info.get('role')} agent; this "
                f"server's config makes it {role} (start both from one config)"
            )
        tier_keys = self._tier_keys(group, info)
        try:
            capacity = GroupCapacity(
                info["num_slots"],
                info["max_seq_len"],
                info["num_blocks"],
                info["block_size"],
                info["max_chunk"],
                role,
                info["chunked_prefill"],
                info["mixed_rows"],
                info["decode_batch_buckets"][-1],
                bool(info.get("prefix_caching", True)),
                tier_keys,
                tier_keys is not None and info.get("kv_tier_write_through") is True,
                self._tier_capacity(info) if tier_keys is not None else None,
                self._state_snapshots(info),
                self._max_proposals(info),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise AgentIncompatible(f"agent {client.address} reported an unusable KV cache: {exc}") from exc
        await client.reset(timeout_s)
        self.eos_ids |= set(info["eos_ids"])
        log.info(
            "agent %d at %s: %s, model %s, %d slots, max length %d, %d KV blocks of %d positions%s",
            group,
            client.address,
            role,
            info["model"],
            capacity.num_slots,
            capacity.max_seq_len,
            capacity.num_blocks,
            capacity.block_size,
            "" if capacity.chunked_prefill else " (prompts in one call: no chunks, no prefix cache)",
        )
        if capacity.mixed_rows:
            log.info(
                "agent %d: a step of decode rows and prompt chunks runs as one call of up to %d rows",
                group,
                capacity.mixed_rows,
            )
        return capacity

    def _tier_keys(self, group: int, info: dict) -> tuple[str, ...] | None:
        """The digests the group's agent holds in its KV tier (runtime.kv_tiers), or None: no tier
        used. Only a mixed group of one agent uses it: a tensor-parallel group's agents each hold
        their own share of the blocks, and a PD prefill group's transfers run beside its steps."""
        keys = info.get("kv_tier_keys")
        if keys is None:
            return None
        group_config = self.config.agents.groups[group]
        if group_config.role != "mixed" or group_config.tensor_parallel > 1:
            log.info("agent %d: its KV tier is not used (only a mixed group of one agent uses one)", group)
            return None
        if not isinstance(keys, list) or not all(isinstance(k, str) for k in keys):
            raise AgentIncompatible(f"agent {self.clients[group].address} reported unusable KV tier keys")
        log.info("agent %d: KV tier on, %d blocks held", group, len(keys))
        return tuple(keys)

    @staticmethod
    def _state_snapshots(info: dict) -> int:
        """The snapshot slots of the agent's Gated DeltaNet states (0: none)."""
        slots = info.get("state_snapshots", 0)
        if type(slots) is not int or not 0 <= slots < 2**31:
            raise ValueError(f"state_snapshots is {slots!r:.40}, not a number of slots")
        return slots

    @staticmethod
    def _max_proposals(info: dict) -> int:
        """The most tokens proposed for one sequence the agent's steps verify (0: none)."""
        most = info.get("max_proposals", 0)
        if type(most) is not int or not 0 <= most <= MAX_DRAFT_TOKENS:
            raise ValueError(f"max_proposals is {most!r:.40}, not 0..{MAX_DRAFT_TOKENS} tokens")
        return most

    @staticmethod
    def _tier_capacity(info: dict) -> int:
        """The most blocks the agent's KV tier holds: its index here never holds more."""
        capacity = info.get("kv_tier_capacity")
        if type(capacity) is not int or capacity < 0:
            raise ValueError(f"kv_tier_capacity is {capacity!r:.40}, not a number of blocks")
        return capacity

    async def recover(self, group: int, stopping: Callable[[], bool]) -> GroupCapacity | None:
        """Probe a failed group until it answers (restarted by the launcher, or resumed): its
        capacity, or None when a newer server holds it now or the engine stops. Fresh socket per
        probe: nothing queued for a dead connection is ever delivered."""
        client, last_reason = self.clients[group], None
        while not stopping():
            client.reconnect()
            try:
                return await self.connect(group, RECOVERY_PROBE_S)
            except AgentTakenOver:  # the agent refused our reset
                self.taken_over.add(group)
                log.error("agent %s: a newer server holds it; this server no longer uses it", client.address)
                return None
            except AgentError as exc:
                if str(exc) != last_reason:
                    last_reason = str(exc)
                    log.warning("agent %s not back yet: %s", client.address, exc)
                await asyncio.sleep(RECOVERY_INTERVAL_S)
        return None

    async def answering(self, healthy: list[bool], timeout_s: float) -> list[bool]:
        """Each group: healthy here and answering a ping now."""
        pings = await asyncio.gather(*(c.ping(timeout_s) for c in self.clients), return_exceptions=True)
        return [ok and not isinstance(ping, BaseException) for ok, ping in zip(healthy, pings)]

    def taken_over_reason(self) -> str:
        addresses = ", ".join(self.clients[group].address for group in sorted(self.taken_over))
        return f"another server took these agents over: {addresses} (this server no longer uses them)"

    def close(self) -> None:
        for client in self.clients:
            client.close()
