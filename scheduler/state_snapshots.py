"""StateSnapshots: a group's snapshot slots of Gated DeltaNet states (Qwen3.5's linear attention:
agent/kernels/gated_delta.h), the other half of prefix caching on a hybrid model.

A prefix-cache hit gives a prompt the K/V of its cached blocks, but a Gated DeltaNet layer keeps no
K/V: a sequence's state there is one fixed-size matrix that has taken in every earlier token. So a
hit is usable only up to a block boundary whose state was saved: the agent copies the state at the
end of a chunk into a snapshot slot (`save`) and later into another sequence's slot (`restore`), as
vLLM's hybrid cache manager keeps a state per cached block and llama.cpp's server keeps context
checkpoints. Snapshots are few (each is a whole state, megabytes), so a prompt saves at most two:
at its last block boundary (the same prompt again, or a conversation's next turn, starts there) and
where its cached prefix ended (a shared system prompt: the next prompt that shares it starts there).

A snapshot is named by the block manager's content serial of the block it ends with: a serial is
never reused, so a snapshot can only be found by the exact prefix it was computed from. The least
recently used registered snapshot goes first when a save needs a slot; a slot a planned restore or
save will use is pinned and never given away meanwhile.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Sequence


class StateSnapshots:
    def __init__(self, slots: int):
        if slots < 1:
            raise ValueError(f"need at least one snapshot slot, got {slots}")
        self.slots = slots
        self.reset()

    def reset(self) -> None:
        """Forget every snapshot: the group's agent restarted, its states are gone."""
        self._free = list(range(self.slots - 1, -1, -1))  # a stack: slot 0 goes first
        self._registered: OrderedDict[int, int] = OrderedDict()  # slot -> serial, least recently used first
        self._by_serial: dict[int, int] = {}  # serial -> slot
        self._reserved: set[int] = set()  # taken for a save not yet done
        self._pins: Counter[int] = Counter()  # slots a planned restore reads
        self.restored = 0  # cumulative: restores planned (prefix hits on snapshots)

    @property
    def held(self) -> int:
        """Snapshots registered (hit-able)."""
        return len(self._registered)

    def usable_hit(self, serials: Sequence[int]) -> tuple[int, int | None]:
        """Of a cached run of blocks (their content serials, in order), the most blocks whose end
        has a snapshot, and that snapshot's slot ((0, None): none)."""
        for blocks in range(len(serials), 0, -1):
            slot = self._by_serial.get(serials[blocks - 1])
            if slot is not None:
                return blocks, slot
        return 0, None

    def pin(self, slot: int) -> None:
        """A restore from `slot` is planned: it is not given away until unpin."""
        assert slot in self._registered, f"snapshot slot {slot} holds no snapshot"
        self._pins[slot] += 1
        self._registered.move_to_end(slot)
        self.restored += 1

    def unpin(self, slot: int) -> None:
        self._pins[slot] -= 1
        if self._pins[slot] <= 0:
            del self._pins[slot]

    def take(self) -> int | None:
        """A slot for a save: a free one, else the least recently used snapshot not pinned (it is
        forgotten); None when every slot is pinned or reserved."""
        if self._free:
            slot = self._free.pop()
        else:
            oldest = next((s for s in self._registered if s not in self._pins), None)
            if oldest is None:
                return None
            slot = oldest
            del self._by_serial[self._registered.pop(slot)]
        self._reserved.add(slot)
        return slot

    def saved(self, slot: int, serial: int) -> None:
        """The save into `slot` ran: the state after the block with content `serial` is there (a
        snapshot of the same prefix already held elsewhere gives its slot back)."""
        self._reserved.discard(slot)
        old = self._by_serial.get(serial)
        if old is not None and old not in self._pins:
            del self._registered[old]
            self._free.append(old)
        elif old is not None:  # the pinned one stays until read; this one is spare
            self._free.append(slot)
            return
        self._by_serial[serial] = slot
        self._registered[slot] = serial

    def release(self, slot: int) -> None:
        """A save planned into `slot` did not run (its step failed or was refused): free again."""
        if slot in self._reserved:
            self._reserved.discard(slot)
            self._free.append(slot)
