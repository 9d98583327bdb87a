"""BlockManager: the paged KV cache of one group, as block tables, with automatic prefix caching.

The group's KV is a pool of `num_blocks` blocks of `block_size` positions; a sequence's position p
lives in block table[p // block_size] at offset p % block_size. The scheduler owns the tables and
sends them to the agents, which only index. Pure logic, like nano-vllm's block manager and vLLM v1's
KVCacheManager/BlockPool:

    hit = blocks.allocate(seq_id, tokens)      # None: no room (preempt or wait); else cached positions
    ... prefill tokens[hit:] ...;  blocks.computed(seq_id, tokens, len(tokens))
    blocks.append(seq_id, len(tokens) + 1)     # False: no room, preempt someone
    blocks.free(seq_id)

Prefix caching: once a FULL block's KV is computed, the block is registered under its content, the
hash chain (parent content, this block's tokens), so a later sequence with the same prefix reuses it
instead of recomputing. The key is exact, never a digest: the parent is named by a serial number
given to each registered content and never reused, so equal keys mean equal token prefixes and a
hash collision can only cost a dict probe, never wrong KV. Only full, computed blocks are shared;
a sequence writes from its hit on, which starts at a block boundary, into blocks it alone holds.

A sequence with a cache salt (a tenant's, asked for per request) starts its chain from the salt
instead of the common root: its blocks are hit only by sequences with the same salt, and never by
or for unsalted ones.

A freed registered block keeps its KV and stays hit-able until it is needed for a new allocation:
free uncached blocks go first, then cached ones least recently freed first (a freed table goes tail
first, so a prefix outlives its continuations).

A second tier (`tiered`: the agents' host memory and disk, agent/kv_tiers.py) keeps what the pool
evicts. It needs names that outlive this process, so with a tier each content also has a digest: the hex
SHA-256 chain over the parent's digest (the salt's, for a first block) and the block's tokens. An
evicted content with no other holder is queued in `spills` (block, digest): the agent must copy
that block out in the next step, before the step writes it. `tier_keys` are the digests the tier
holds (spilled here, or reported by the agents at start). A lookup that ends in the pool goes on in
`tier_keys`; those blocks are allocated fresh, queued in `restores` (digest, block) for the agent
to read back before it computes, and count as hit positions. With `write_through` (a tier that
outlives the process: a disk) a content is also queued to spill when it is first registered, so a
prefix still in the pool when the server or its agent stops is found after the restart; its
eviction spills it again (the tier may have let it go meanwhile). They are registered only by
computed(), as any block is, once the step that restored them succeeded: a restore that failed
(the tier lost the block) is never hit by another sequence; `restore_failed` forgets its digests,
and the scheduler recomputes that sequence from the failed block on.

`tier_keys` is bounded by what the tier holds: the agent reports the digests its tier let go (its
least recently used, with the steps that move blocks) and `tier_evicted` forgets them; and it never
holds more than `tier_capacity` (the tier's blocks, as its agent reported them), the least recently
spilled or restored going first, so lost reports cannot grow it either.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass, field

_ROOT = 0  # the parent serial of a sequence's first block (without a cache salt)

# (parent content's serial, or the cache salt of a first block: never equal to a serial; this
# block's tokens)
ContentKey = tuple[int | str, tuple[int, ...]]


@dataclass(eq=False)
class _Content:
    """One registered block content: its key, its serial (the parent of the next block's key) and
    the blocks holding it (several when sequences computed the same prefix concurrently)."""

    key: ContentKey
    serial: int
    digest: str  # the hex SHA-256 chain: the second tier's name for it
    holders: dict[int, None] = field(default_factory=dict)


@dataclass
class _Progress:
    """How far a sequence's blocks are registered: the first `blocks` of its table, the last of which
    has content serial `serial`."""

    blocks: int = 0
    serial: int | str = _ROOT
    digest: str = ""


class BlockManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        tiered: bool = False,
        write_through: bool = False,
        tier_capacity: int | None = None,
    ):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.tiered = tiered and enable_prefix_caching
        self.write_through = write_through and self.tiered
        self.tier_capacity = tier_capacity  # the most blocks the tier holds (None: unbounded)
        self.tier_hit_tokens = 0  # cumulative: of the hit tokens, the ones restored from the tier
        self.query_tokens = 0  # cumulative: prompt tokens looked up in the cache
        self.hit_tokens = 0  # cumulative: of those, the ones found computed
        self.reset()

    def reset(self) -> None:
        """Free every table and forget the cache: the group's KV is gone (an agent restarted)."""
        self._refs = [0] * self.num_blocks
        self._free_plain = list(range(self.num_blocks - 1, -1, -1))  # a stack; block 0 goes first
        self._free_cached: OrderedDict[int, None] = OrderedDict()  # LRU: first = least recently freed
        self._contents: dict[ContentKey, _Content] = {}
        self._content_of: dict[int, _Content] = {}  # registered block -> its content
        self._next_serial = _ROOT + 1
        self._tables: dict[Hashable, list[int]] = {}
        self._progress: dict[Hashable, _Progress] = {}
        # the tier outlives the pool (an agent restart re-seeds it: seed_tier); least recently
        # spilled or restored first
        self.tier_keys: OrderedDict[str, None] = OrderedDict()
        self.spills: list[tuple[int, str]] = []  # (block, digest): copy out before overwriting
        self.restores: list[tuple[str, int]] = []  # (digest, block): read back before computing

    # --- gauges and queries ---

    @property
    def num_free(self) -> int:
        """Blocks an allocation may take: unused, or cached with no holder (evicted on use)."""
        return len(self._free_plain) + len(self._free_cached)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    @property
    def num_cached(self) -> int:
        """Blocks holding registered (hit-able) KV, in use or not."""
        return len(self._content_of)

    def blocks_for(self, length: int) -> int:
        return -(-length // self.block_size)

    def table(self, key: Hashable) -> list[int]:
        return list(self._tables[key])

    def __contains__(self, key: Hashable) -> bool:
        return key in self._tables

    def blocks_needed(
        self, tokens: Sequence[int], salt: str | None = None, reuse: bool = True, max_hit: int | None = None
    ) -> int:
        """Free blocks `allocate(key, tokens, salt, reuse, max_hit)` would take now (hits on blocks
        in use cost none)."""
        hits, _ = self._lookup(tokens, salt, max_hit) if reuse else ([], [])
        return self.blocks_for(len(tokens)) - sum(1 for _, block in hits if self._refs[block])

    def can_allocate(
        self, tokens: Sequence[int], salt: str | None = None, reuse: bool = True, max_hit: int | None = None
    ) -> bool:
        return self.blocks_needed(tokens, salt, reuse, max_hit) <= self.num_free

    def cached_serials(self, tokens: Sequence[int], salt: str | None = None) -> list[int]:
        """The content serials of the pool's cached run of full blocks matching tokens' prefix (as
        allocate would hit it, the tier aside): what names a state snapshot at each block's end
        (scheduler/state_snapshots.py)."""
        hits, _ = self._lookup(tokens, salt)
        return [content.serial for content, _ in hits]

    def serial_of(self, key: Hashable, block: int) -> int | None:
        """The content serial of `key`'s block `block` (its index in the table), None while it is
        not registered."""
        content = self._content_of.get(self._tables[key][block])
        return None if content is None else content.serial

    # --- changes ---

    def allocate(
        self,
        key: Hashable,
        tokens: Sequence[int],
        salt: str | None = None,
        reuse: bool = True,
        max_hit: int | None = None,
    ) -> int | None:
        """Give `key` a table covering len(tokens) positions, reusing the longest cached prefix of
        full blocks (computed with the same cache `salt`; none with reuse False: every position's
        logits are needed), of at most `max_hit` positions, but leaving at least the last token to
        compute (its logits are needed).
        Returns the positions already computed (a multiple of block_size), or None, changing
        nothing, when the free blocks do not suffice."""
        if key in self._tables:
            raise ValueError(f"{key!r} already has a block table")
        hits, tier = self._lookup(tokens, salt, max_hit) if reuse else ([], [])
        total = self.blocks_for(len(tokens))
        if total - sum(1 for _, block in hits if self._refs[block]) > self.num_free:
            return None
        table = []
        for _, block in hits:  # claim the hits first: a free one is revived, not evicted below
            if self._refs[block] == 0:
                del self._free_cached[block]
            self._refs[block] += 1
            table.append(block)
        table.extend(self._take() for _ in range(total - len(hits)))
        # the tier's blocks follow the pool's: restored into the first fresh ones
        self.restores += zip(tier, table[len(hits) : len(hits) + len(tier)])
        self._index_tier(tier)  # used: the tier keeps them longest too
        self._tables[key] = table
        last = hits[-1][0] if hits else None
        self._progress[key] = (
            _Progress(len(hits), last.serial, last.digest)
            if last
            else _Progress(0, _root(salt), _root_digest(salt))
        )
        hit = (len(hits) + len(tier)) * self.block_size
        if self.enable_prefix_caching:
            self.query_tokens += len(tokens)
            self.hit_tokens += hit
            self.tier_hit_tokens += len(tier) * self.block_size
        return hit

    def append(self, key: Hashable, length: int) -> bool:
        """Grow `key`'s table to cover `length` positions; False, changing nothing, if the free
        blocks do not suffice (the scheduler then preempts)."""
        table = self._tables[key]
        missing = self.blocks_for(length) - len(table)
        if missing > self.num_free:
            return False
        table.extend(self._take() for _ in range(missing))
        return True

    def computed(self, key: Hashable, tokens: Sequence[int], upto: int) -> None:
        """Positions [0, upto) of `key` now hold the KV of tokens[:upto]: register the full blocks
        among them so later sequences can hit them. A content some other block already holds gets
        this block as one more holder; the existing registration stays as it is."""
        table = self._tables[key]
        if upto > len(tokens) or upto > len(table) * self.block_size:
            raise ValueError(f"computed up to {upto} beyond the tokens or the table of {key!r}")
        if not self.enable_prefix_caching:
            return
        progress = self._progress[key]
        size = self.block_size
        for i in range(progress.blocks, upto // size):
            content_key = (progress.serial, tuple(tokens[i * size : (i + 1) * size]))
            content = self._contents.get(content_key)
            if content is None:
                # a digest names a block in the tier only: no SHA-256 on the step path without one
                digest = _digest(progress.digest, content_key[1]) if self.tiered else ""
                content = self._contents[content_key] = _Content(content_key, self._next_serial, digest)
                self._next_serial += 1
                if self.write_through and digest not in self.tier_keys:
                    self.spills.append((table[i], digest))
                    self._index_tier([digest])
            block = table[i]
            assert block not in self._content_of, f"block {block} is registered twice"
            content.holders[block] = None
            self._content_of[block] = content
            progress.blocks, progress.serial, progress.digest = i + 1, content.serial, content.digest

    def truncate(self, key: Hashable, length: int) -> None:
        """Shrink `key`'s table to the blocks of `length` positions: blocks taken for positions it
        did not keep (speculative decoding's rejected proposals) go back, never yet registered."""
        table = self._tables[key]
        keep = self.blocks_for(length)
        if keep < self._progress[key].blocks:
            raise ValueError(f"{key!r} cannot drop blocks it registered as computed")
        for block in reversed(table[keep:]):
            self._refs[block] -= 1
            if self._refs[block] == 0:
                self._free_plain.append(block)
        del table[keep:]

    def free(self, key: Hashable) -> None:
        """Drop `key`'s table (no-op if it has none). Its blocks with no other holder become free;
        registered ones keep their KV, hit-able until evicted, the table's tail first in line."""
        table = self._tables.pop(key, None)
        self._progress.pop(key, None)
        for block in reversed(table or ()):
            self._refs[block] -= 1
            if self._refs[block] == 0:
                if block in self._content_of:
                    self._free_cached[block] = None
                else:
                    self._free_plain.append(block)

    def drop_cache(self) -> int:
        """Forget every cached prefix (an operator's reset); returns how many blocks held one. No
        block is hit again: free cached blocks become plain free ones, and the tier's index and the
        spills not yet sent go (the agents empty the tier itself). Blocks in use keep their KV for
        their sequences, and the restores already queued stay: the sequences that hit them need
        them (one the tier then lacks is recomputed, as any failed restore is)."""
        dropped = len(self._content_of)
        self._free_plain.extend(self._free_cached)
        self._free_cached.clear()
        self._contents.clear()
        self._content_of.clear()
        self.tier_keys.clear()
        self.spills.clear()
        return dropped

    # --- the second tier ---

    def seed_tier(self, digests: Sequence[str]) -> None:
        """The tier's blocks as an agent reported them (at start: what its disk kept), the most
        recently used first."""
        if self.tiered:
            self._index_tier(reversed(digests))

    def take_spills(self) -> list[tuple[int, str]]:
        """The (block, digest) pairs to copy out in the next step, before it writes them."""
        spills, self.spills = self.spills, []
        return spills

    def take_restores(self) -> list[tuple[str, int]]:
        """The (digest, block) pairs to read back in the next step, before it computes."""
        restores, self.restores = self.restores, []
        return restores

    def restore_failed(self, digests: Sequence[str]) -> None:
        """The tier did not have these (evicted, dropped, corrupt): never looked up there again.
        Their blocks were never registered, so nothing else hit them."""
        self.tier_evicted(digests)

    def tier_evicted(self, digests: Iterable[str]) -> None:
        """The tier let these go (its agent's report): no longer looked up there."""
        for digest in digests:
            self.tier_keys.pop(digest, None)

    # --- internals ---

    def _lookup(
        self, tokens: Sequence[int], salt: str | None, max_hit: int | None = None
    ) -> tuple[list[tuple[_Content, int]], list[str]]:
        """The cached run of full blocks matching tokens' prefix, at most len(tokens) - 1 positions
        (and `max_hit`): (content, block) per block, preferring a holder in use (it costs no free
        block); then the digests of the run that goes on in the tier."""
        if not self.enable_prefix_caching:
            return [], []
        size = self.block_size
        hits: list[tuple[_Content, int]] = []
        serial, digest = _root(salt), _root_digest(salt)
        limit = max(len(tokens) - 1, 0) // size
        if max_hit is not None:
            limit = min(limit, max_hit // size)
        for i in range(limit):
            content = self._contents.get((serial, tuple(tokens[i * size : (i + 1) * size])))
            if content is None:
                break
            block = next((b for b in content.holders if self._refs[b]), next(iter(content.holders)))
            hits.append((content, block))
            serial, digest = content.serial, content.digest
        tier: list[str] = []
        if self.tiered:
            for i in range(len(hits), limit):
                digest = _digest(digest, tokens[i * size : (i + 1) * size])
                if digest not in self.tier_keys:
                    break
                tier.append(digest)
        return hits, tier

    def _take(self) -> int:
        """A free block for new KV: an uncached one if any, else the least recently freed cached one,
        whose registration goes (its content stays registered while another block holds it)."""
        if self._free_plain:
            block = self._free_plain.pop()
        else:
            block, _ = self._free_cached.popitem(last=False)
            content = self._content_of.pop(block)
            del content.holders[block]
            if not content.holders:
                del self._contents[content.key]
                if self.tiered:  # its last copy: into the tier, before the new owner writes it
                    self.spills.append((block, content.digest))
                    self._index_tier([content.digest])
        self._refs[block] = 1
        return block

    def _index_tier(self, digests: Iterable[str]) -> None:
        """These digests are in the tier, the most recently used last; the least recently used go
        past its capacity (the tier has let them go, whether or not its report came)."""
        for digest in digests:
            self.tier_keys[digest] = None
            self.tier_keys.move_to_end(digest)
        while self.tier_capacity is not None and len(self.tier_keys) > self.tier_capacity:
            self.tier_keys.popitem(last=False)


def _root(salt: str | None) -> int | str:
    """The parent of a sequence's first block: the common root, or its cache salt."""
    return _ROOT if salt is None else salt


def _root_digest(salt: str | None) -> str:
    """The digest chain's start: the common root's, or the salt's (kept apart from the root's)."""
    # surrogatepass: total over every str (the APIs refuse lone surrogates; an engine loop that
    # met one anyway would fail every request on it)
    seed = b"root" if salt is None else b"salt:" + salt.encode("utf-8", "surrogatepass")
    return hashlib.sha256(seed).hexdigest()


def _digest(parent: str, tokens: Sequence[int]) -> str:
    """A block's digest: its parent's and its tokens (as fixed-width integers: no two token lists
    give the same bytes)."""
    payload = bytes.fromhex(parent) + b"".join(t.to_bytes(8, "little", signed=True) for t in tokens)
    return hashlib.sha256(payload).hexdigest()
