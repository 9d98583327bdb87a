"""Placement: the groups' slots and KV block pools, their health, and where a new sequence goes.
Pure bookkeeping for the BatchScheduler (scheduler/batch_scheduler.py), which owns one.

A group holds a sequence in a slot (a batch row: its sampling state on the agent; at most
`usable_slots` of them) and its
KV in blocks (scheduler/block_manager.py: the tables are the scheduler's, sent with each call).

PD disaggregation: a sequence placed on a `decode` group also gets a slot and blocks of a `prefill`
group. The prefill group frees that slot itself once the transfer is over (`free_prefill_slot`).
"""

from __future__ import annotations

from scheduler.block_manager import BlockManager
from scheduler.plan import GroupCapacity
from scheduler.sequence import Sequence
from scheduler.state_snapshots import StateSnapshots


class Placement:
    def __init__(self, groups: list[GroupCapacity], enable_prefix_caching: bool = True):
        self.groups = groups
        self.enable_prefix_caching = enable_prefix_caching
        self.free_slots = [list(range(g.usable_slots)) for g in groups]
        self.blocks = [self._block_manager(g) for g in groups]
        self.snapshots = [self._snapshots(g) for g in groups]
        self.healthy = [True] * len(groups)
        self.prefix_query_tokens = 0  # cumulative: prompt tokens looked up in a prefix cache
        self.prefix_hit_tokens = 0  # of those, found computed
        self.prefix_tier_hit_tokens = 0  # of those, restored from the second tier

    def _block_manager(self, capacity: GroupCapacity) -> BlockManager:
        # A decode group's blocks are written by transfers of whole prompts: no hits there.
        caching = (
            self.enable_prefix_caching
            and capacity.chunked_prefill
            and capacity.prefix_caching
            and capacity.role != "decode"
        )
        blocks = BlockManager(
            capacity.num_blocks,
            capacity.block_size,
            caching,
            tiered=capacity.tier_keys is not None,
            write_through=capacity.tier_write_through,
            tier_capacity=capacity.tier_capacity,
        )
        blocks.seed_tier(capacity.tier_keys or ())
        return blocks

    def _snapshots(self, capacity: GroupCapacity) -> StateSnapshots | None:
        """A hybrid model's state snapshots, where its group keeps some and caches prefixes."""
        if not capacity.state_snapshots or not self.enable_prefix_caching or not capacity.prefix_caching:
            return None
        return StateSnapshots(capacity.state_snapshots)

    def usable(self, group: int) -> bool:
        """Healthy, and a decode-capable group has a way to get prompts (itself or a prefill group)."""
        capacity = self.groups[group]
        if not self.healthy[group]:
            return False
        if capacity.role == "decode":
            return any(self.healthy[i] and g.role == "prefill" for i, g in enumerate(self.groups))
        if capacity.role == "prefill":
            return any(self.usable(i) for i, g in enumerate(self.groups) if g.role == "decode")
        return True

    @property
    def can_serve(self) -> bool:
        """Some healthy group decodes, and gets prompts (prefills them itself or has a prefill group)."""
        return any(g.decodes and self.usable(i) for i, g in enumerate(self.groups))

    def longest_prompt(self) -> int:
        """The longest prompt some usable group prefills and some decodes (while one can serve)."""
        usable = [g for i, g in enumerate(self.groups) if self.usable(i)]
        return min(
            max(g.max_prompt_len for g in usable if g.prefills),
            max(g.max_prompt_len for g in usable if g.decodes),
        )

    def longest_sequence(self) -> int:
        """The most positions a sequence holds on a usable decode-capable group."""
        return max(g.max_seq_len for i, g in enumerate(self.groups) if g.decodes and self.usable(i))

    def free_slot_count(self) -> int:
        """Free slots of the usable decode-capable groups."""
        return sum(len(self.free_slots[i]) for i, g in enumerate(self.groups) if g.decodes and self.usable(i))

    def free_slot(self, group: int, slot: int) -> None:
        """The slot goes back to the group's free ones (the lowest is handed out first)."""
        if slot not in self.free_slots[group]:
            self.free_slots[group].append(slot)
            self.free_slots[group].sort()

    def place(self, seq: Sequence, groups: list[int]) -> tuple[int, int | None] | None:
        """(group to decode on, prefill group or None): of the open groups with a free slot and the
        blocks for this prompt, the decode-capable one with the most free slots; a decode group
        needs a prefill group with room too, the one with the most free slots."""

        def fits(i: int) -> bool:
            capacity = self.groups[i]
            return (
                bool(self.free_slots[i])
                and len(seq.prompt) <= capacity.max_prompt_len
                and self.blocks[i].can_allocate(
                    seq.prompt, seq.cache_salt, not seq.scoring_prompt, self._state_hit(i, seq, seq.prompt)[0]
                )
            )

        prefill = max(
            (i for i in groups if self.groups[i].role == "prefill" and fits(i)),
            key=lambda i: len(self.free_slots[i]),
            default=None,
        )
        candidates = [
            i
            for i in groups
            if self.groups[i].decodes and fits(i) and (self.groups[i].role == "mixed" or prefill is not None)
        ]
        group = max(candidates, key=lambda i: len(self.free_slots[i]), default=None)
        if group is None:
            return None
        return group, (prefill if self.groups[group].role == "decode" else None)

    def allocate(
        self, group: int, seq: Sequence, tokens: list[int], max_hit: int | None = None
    ) -> int | None:
        """Blocks for `tokens` on the group (None: too few free); the positions its cache holds, at
        most `max_hit`."""
        blocks = self.blocks[group]
        reuse = not seq.scoring_prompt
        from_tier = blocks.tier_hit_tokens
        max_hit, restore, cached = self._state_hit(group, seq, tokens, max_hit)
        hit = blocks.allocate(seq.request_id, tokens, seq.cache_salt, reuse=reuse, max_hit=max_hit)
        snapshots = self.snapshots[group]
        if hit is not None and snapshots is not None:
            self._plan_states(seq, snapshots, hit, restore, cached, len(tokens), blocks.block_size)
        if hit is not None and blocks.enable_prefix_caching:
            self.prefix_query_tokens += len(tokens)
            self.prefix_hit_tokens += hit
            self.prefix_tier_hit_tokens += blocks.tier_hit_tokens - from_tier
        return hit

    def _state_hit(
        self, group: int, seq: Sequence, tokens: list[int], max_hit: int | None = None
    ) -> tuple[int | None, int | None, int]:
        """A hybrid model's hit ends where a state snapshot does: the most positions it may hit
        (within `max_hit`), the snapshot it then restores, and where the cached run of blocks ends
        (max_hit, None, 0 for other models)."""
        snapshots, blocks = self.snapshots[group], self.blocks[group]
        if snapshots is None or seq.scoring_prompt:
            return max_hit, None, 0
        size = blocks.block_size
        serials = blocks.cached_serials(tokens, seq.cache_salt)
        within = serials if max_hit is None else serials[: max_hit // size]
        usable, restore = snapshots.usable_hit(within)
        return usable * size, restore, len(serials) * size

    @staticmethod
    def _plan_states(
        seq: Sequence,
        snapshots: StateSnapshots,
        hit: int,
        restore: int | None,
        cached: int,
        length: int,
        size: int,
    ) -> None:
        """A hybrid model's sequence: the snapshot its hit restores (pinned until read), and where
        its chunks save its state: where its cached prefix ends (a prompt sharing it starts there
        next), and its last block boundary (the same prompt, or the conversation's next turn)."""
        seq.state_restore = restore if hit else None
        if seq.state_restore is not None:
            snapshots.pin(seq.state_restore)
        last = (length - 1) // size * size
        seq.state_saves = sorted({p for p in (cached, last) if hit < p <= last})

    def restored(self, seq: Sequence) -> None:
        """The sequence no longer needs the snapshot its hit restores (its chunk ran, or it ended
        or was preempted)."""
        group, restore = seq.group, seq.state_restore
        seq.state_restore = None
        snapshots = None if group is None else self.snapshots[group]
        if restore is not None and snapshots is not None:
            snapshots.unpin(restore)

    def drop_states(self, seq: Sequence) -> None:
        """The sequence ended or was preempted: no restore, no save (a recompute plans its own)."""
        self.restored(seq)
        seq.state_saves = []

    def free_prefill_slot(self, seq: Sequence, computed: bool) -> None:
        """The prefill group frees its slot itself once the transfer is over, either way; its
        blocks keep the prompt for later hits when it was computed."""
        group, slot = seq.prefill_group, seq.prefill_slot
        seq.prefill_slot = None
        if slot is None:
            return
        assert group is not None, "a prefill slot comes with its prefill group"
        if not self.healthy[group]:
            return
        blocks = self.blocks[group]
        if computed and seq.request_id in blocks:
            blocks.computed(seq.request_id, seq.prompt, len(seq.prompt))
        blocks.free(seq.request_id)
        self.free_slot(group, slot)

    def failed(self, group: int) -> None:
        """The group is unusable: its slots and blocks are forgotten until it returns."""
        self.healthy[group] = False
        self.free_slots[group] = []
        self.blocks[group].reset()
        snapshots = self.snapshots[group]
        if snapshots is not None:
            snapshots.reset()

    def recovered(self, group: int, capacity: GroupCapacity) -> None:
        self.groups[group] = capacity
        self.free_slots[group] = list(range(capacity.usable_slots))
        self.blocks[group] = self._block_manager(capacity)
        self.snapshots[group] = self._snapshots(capacity)
        self.healthy[group] = True
