"""BlockManager: block tables, refcounts, the prefix cache's hash chain and LRU eviction; then random
allocate/compute/append/free runs (hypothesis) against a model of the KV each block physically holds."""

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from scheduler.block_manager import BlockManager


def state(bm: BlockManager):
    """Everything an allocation may change, to prove a refused one changed nothing."""
    return (
        {k: list(t) for k, t in bm._tables.items()},
        list(bm._refs),
        list(bm._free_plain),
        list(bm._free_cached),
        dict(bm._content_of),
        bm.query_tokens,
        bm.hit_tokens,
    )


def run(bm: BlockManager, key, tokens) -> int:
    """Allocate and compute the whole of `tokens`, as a prefill would; returns the hit."""
    hit = bm.allocate(key, tokens)
    assert hit is not None
    bm.computed(key, tokens, len(tokens))
    return hit


def test_allocate_covers_the_tokens_with_fresh_blocks():
    bm = BlockManager(8, 4)
    assert bm.allocate("a", list(range(9))) == 0
    assert bm.table("a") == [0, 1, 2]
    assert (bm.num_used, bm.num_free, bm.num_cached) == (3, 5, 0)
    assert bm.allocate("b", [1]) == 0
    assert bm.table("b") == [3]
    with pytest.raises(ValueError):
        bm.allocate("a", [1])


def test_hit_reuses_computed_full_blocks_and_counts_refs():
    bm = BlockManager(8, 4)
    prompt = list(range(10))  # blocks [0..3] [4..7] [8, 9]
    run(bm, "a", prompt)
    assert bm.num_cached == 2  # the partial third block is never registered
    assert bm.allocate("b", prompt) == 8
    a, b = bm.table("a"), bm.table("b")
    assert b[:2] == a[:2] and b[2] != a[2]
    assert [bm._refs[x] for x in a] == [2, 2, 1]
    assert bm.num_used == 4  # the hits on live blocks took no free block


def test_uncomputed_blocks_are_never_hit():
    bm = BlockManager(8, 4)
    prompt = list(range(12))
    bm.allocate("a", prompt)
    assert bm.allocate("b", prompt) == 0
    bm.computed("a", prompt, 5)  # one full block computed, the second only in part
    assert bm.allocate("c", prompt) == 4
    assert set(bm.table("c")[1:]).isdisjoint(bm.table("a"))


def test_hit_stops_at_the_first_differing_block_and_needs_the_same_earlier_blocks():
    bm = BlockManager(16, 2)
    run(bm, "a", [1, 2, 3, 4, 5, 6, 7])
    assert bm.allocate("same_start", [1, 2, 3, 4, 9, 9, 7]) == 4
    assert bm.allocate("other_start", [0, 0, 3, 4, 5, 6, 7]) == 0  # same later blocks, other chain
    assert bm.allocate("inside", [3, 4, 5, 6, 7]) == 0  # a block's content alone is not a prefix


def test_hit_never_covers_the_last_token():
    bm = BlockManager(8, 4)
    prompt = list(range(8))
    run(bm, "a", prompt)
    assert bm.num_cached == 2
    assert bm.allocate("b", prompt) == 4  # both blocks cached, yet the last token is computed
    assert bm.table("b")[1] != bm.table("a")[1]
    assert bm.allocate("c", prompt + [8]) == 8
    assert bm.allocate("d", prompt[:4]) == 0
    assert bm.allocate("e", []) == 0 and bm.table("e") == []


def test_free_keeps_cached_blocks_hit_able_and_revives_them():
    bm = BlockManager(4, 2)
    run(bm, "a", [1, 2, 3, 4, 5])
    table = bm.table("a")
    bm.free("a")
    assert (bm.num_free, bm.num_cached) == (4, 2)
    assert bm.allocate("b", [1, 2, 3, 4, 6]) == 4
    assert bm.table("b")[:2] == table[:2]  # revived, not evicted
    assert bm.num_free == 1
    bm.free("missing")  # freeing a sequence with no table is a no-op


def test_eviction_takes_uncached_blocks_first_then_least_recently_freed_tail_first():
    bm = BlockManager(6, 2)
    run(bm, "a", [1, 2, 3, 4, 5])  # blocks 0 1 cached, 2 partial
    run(bm, "b", [7, 8, 9])  # block 3 cached, 4 partial
    a, b = bm.table("a"), bm.table("b")
    bm.free("a")
    bm.free("b")
    # LRU of cached free blocks: a's tail first (1, 0), then b's (3); uncached (2, 4, 5) go before any
    assert list(bm._free_cached) == [a[1], a[0], b[0]]
    assert bm.allocate("c", [0] * 7) == 0  # 4 blocks: the 3 uncached, then a[1]
    assert a[1] in bm.table("c") and bm.num_cached == 2
    assert bm.allocate("d", [1, 2, 0]) == 2  # a[0] is still cached: revived; its tail evicts b[0]
    assert bm.table("d") == [a[0], b[0]] and bm.num_cached == 1
    assert bm.num_free == 0 and bm.allocate("e", [1]) is None


def test_append_grows_across_block_boundaries_only():
    bm = BlockManager(3, 4)
    bm.allocate("a", [1, 2, 3])
    assert bm.append("a", 4) and bm.table("a") == [0]
    assert bm.append("a", 5) and bm.table("a") == [0, 1]
    assert not bm.append("a", 13) and bm.table("a") == [0, 1]  # no room for 4 blocks: nothing changes
    assert bm.append("a", 12) and len(bm.table("a")) == 3
    assert bm.append("a", 12)  # already covered: nothing needed


def test_out_of_blocks_changes_nothing():
    bm = BlockManager(4, 2)
    run(bm, "a", [1, 2, 3, 4, 5])
    bm.free("a")
    bm.allocate("b", [9, 9])
    before = state(bm)
    assert not bm.can_allocate([1, 2, 3, 4, 5, 6, 7, 8])
    assert bm.allocate("c", [1, 2, 3, 4, 5, 6, 7, 8]) is None
    assert state(bm) == before
    assert bm.allocate("c", [1, 2, 3, 4, 5, 6]) == 4  # the hits are free cached blocks: revived
    before = state(bm)
    assert not bm.append("c", 7) and state(bm) == before
    assert bm.blocks_needed([1, 2, 3, 4, 5, 6]) == 1  # the hits are now in use: free of charge


def test_same_prefix_computed_twice_keeps_one_content_with_two_holders():
    bm = BlockManager(8, 2)
    bm.allocate("a", [1, 2, 3, 4, 5])
    bm.allocate("b", [1, 2, 3, 4, 6])  # concurrent prefill: nothing computed yet
    bm.computed("a", [1, 2, 3, 4, 5], 5)
    bm.computed("b", [1, 2, 3, 4, 6], 5)
    assert len(bm._contents) == 2 and bm.num_cached == 4
    bm.free("a")
    assert bm.blocks_needed([1, 2, 3, 4, 7]) == 1  # hits b's live copies, not a's free ones
    for filler in range(5):  # 3 uncached blocks, then a's two: b's copies keep the prefix reachable
        bm.allocate(filler, [0])
    assert bm.num_cached == 2
    bm.free(0)
    assert bm.allocate("c", [1, 2, 3, 4, 7]) == 4
    assert bm.table("c")[:2] == bm.table("b")[:2]


def test_reset_frees_everything_and_forgets_the_cache():
    bm = BlockManager(4, 2)
    run(bm, "a", [1, 2, 3])
    bm.reset()
    assert (bm.num_free, bm.num_cached) == (4, 0) and "a" not in bm
    assert bm.allocate("a", [1, 2, 3]) == 0


def test_stats_count_query_and_hit_tokens():
    bm = BlockManager(8, 2)
    run(bm, "a", [1, 2, 3, 4, 5])
    run(bm, "b", [1, 2, 3, 4, 6])
    assert (bm.query_tokens, bm.hit_tokens) == (10, 4)
    assert bm.allocate("c", list(range(20))) is None  # a refused allocation is no lookup
    assert (bm.query_tokens, bm.hit_tokens) == (10, 4)
    assert (bm.num_used, bm.num_free, bm.num_cached) == (4, 4, 2)


def test_without_prefix_caching_nothing_is_hit_or_registered():
    bm = BlockManager(8, 2, enable_prefix_caching=False)
    run(bm, "a", [1, 2, 3, 4, 5])
    assert run(bm, "b", [1, 2, 3, 4, 5]) == 0
    assert bm.num_cached == 0 and (bm.query_tokens, bm.hit_tokens) == (0, 0)


class Live:
    """A running sequence as the scheduler sees it: its tokens (the table covers them all) and how
    many of them have their KV computed."""

    def __init__(self, tokens: list[int], computed: int):
        self.tokens = tokens
        self.computed = computed


class BlockTables(RuleBasedStateMachine):
    """Random runs on a small pool, tokens from a 2-letter alphabet so prefixes collide often. `kv`
    models what each block physically holds: written only by the sequence computing it, read on a
    hit; a hit that reads anything other than the sequence's own tokens is wrong KV."""

    @initialize(
        block_size=st.integers(1, 3),
        num_blocks=st.integers(1, 16),
        caching=st.sampled_from([True, True, False]),  # mostly on: that is where the bugs would be
    )
    def setup(self, block_size, num_blocks, caching):
        self.bm = BlockManager(num_blocks, block_size, caching)
        self.live: dict[int, Live] = {}
        self.seen: list[list[int]] = []  # every sequence's tokens, to draw shared prefixes from
        self.kv: dict[int, dict[int, tuple[int, ...]]] = {b: {} for b in range(num_blocks)}  # offset: prefix
        self.next_key = 0

    def owners(self, block: int) -> int:
        return sum(block in self.bm._tables[k] for k in self.live)

    def admit(self, key: int, tokens: list[int], prefill: bool = False) -> None:
        size = self.bm.block_size
        expected = self.expected_hit(tokens)
        before = state(self.bm)
        hit = self.bm.allocate(key, tokens)
        if hit is None:
            assert state(self.bm) == before
            assert self.bm.blocks_needed(tokens) > self.bm.num_free
            # hits on blocks live sequences hold cost no free block
            assert self.bm.blocks_for(len(tokens)) - expected // size > self.bm.num_free
            return
        assert hit % size == 0 and hit <= max(len(tokens) - 1, 0)
        assert hit >= expected, "a prefix held computed by a live sequence was missed"
        table = self.bm.table(key)
        for p in range(hit):
            assert self.kv[table[p // size]][p % size] == tuple(tokens[: p + 1]), "hit on wrong KV"
        self.live[key] = Live(tokens, hit)
        self.seen.append(tokens)
        if prefill:
            self.write(key, len(tokens))

    def expected_hit(self, tokens: list[int]) -> int:
        """The cache must at least find what live sequences hold computed (their blocks cannot be
        evicted), in whole blocks and short of the last token."""
        if not self.bm.enable_prefix_caching:
            return 0
        size = self.bm.block_size
        best = 0
        for seq in self.live.values():
            n = 0
            while n < min(seq.computed, len(tokens)) and seq.tokens[n] == tokens[n]:
                n += 1
            best = max(best, n)
        return min(best // size * size, max(len(tokens) - 1, 0) // size * size)

    def write(self, key: int, upto: int) -> None:
        """Compute the sequence's KV up to `upto`, writing only blocks it holds alone."""
        seq, table, size = self.live[key], self.bm.table(key), self.bm.block_size
        for p in range(seq.computed, upto):
            block = table[p // size]
            assert self.owners(block) == 1, f"block {block} written while shared"
            self.kv[block][p % size] = tuple(seq.tokens[: p + 1])  # KV depends on the whole prefix
        self.bm.computed(key, seq.tokens, upto)
        seq.computed = max(seq.computed, upto)

    @rule(tokens=st.lists(st.integers(0, 1), min_size=1, max_size=12), prefill=st.booleans())
    def allocate(self, tokens, prefill):
        self.next_key += 1
        self.admit(self.next_key, tokens, prefill)

    @precondition(lambda self: self.seen)
    @rule(data=st.data(), suffix=st.lists(st.integers(0, 1), max_size=6), prefill=st.booleans())
    def allocate_sharing_a_prefix(self, data, suffix, prefill):
        earlier = data.draw(st.sampled_from(self.seen))
        tokens = earlier[: data.draw(st.integers(0, len(earlier)))] + suffix
        if tokens:
            self.next_key += 1
            self.admit(self.next_key, tokens, prefill)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def compute(self, data):
        key = data.draw(st.sampled_from(sorted(self.live)))
        seq = self.live[key]
        if seq.computed == len(seq.tokens):
            return
        self.write(key, data.draw(st.integers(seq.computed + 1, len(seq.tokens))))

    @precondition(lambda self: self.live)
    @rule(data=st.data(), token=st.integers(0, 1))
    def decode(self, data, token):
        key = data.draw(st.sampled_from(sorted(self.live)))
        seq = self.live[key]
        if seq.computed < len(seq.tokens):
            return
        before = state(self.bm)
        if self.bm.append(key, len(seq.tokens) + 1):
            seq.tokens.append(token)
        else:
            assert state(self.bm) == before

    @precondition(lambda self: self.live)
    @rule(
        data=st.data(),
        proposed=st.lists(st.integers(0, 1), min_size=1, max_size=5),
        kept=st.integers(0, 5),
    )
    def speculate(self, data, proposed, kept):
        """Speculative decoding's step: blocks for the pending token and the proposals, the KV of
        all of them written, `kept` proposals kept (the step's token after them is the next
        decode's pending one), the rest's blocks given back (truncate)."""
        key = data.draw(st.sampled_from(sorted(self.live)))
        seq, size = self.live[key], self.bm.block_size
        if seq.computed < len(seq.tokens):
            return
        before = state(self.bm)
        pending = data.draw(st.integers(0, 1))
        if not self.bm.append(key, len(seq.tokens) + 1 + len(proposed)):
            assert state(self.bm) == before
            return
        written, table = [*seq.tokens, pending, *proposed], self.bm.table(key)
        for p in range(len(seq.tokens), len(written)):
            assert self.owners(table[p // size]) == 1, "a proposal's block is shared"
            self.kv[table[p // size]][p % size] = tuple(written[: p + 1])
        seq.tokens = written[: len(seq.tokens) + 1 + min(kept, len(proposed))]
        self.bm.computed(key, seq.tokens, len(seq.tokens))
        seq.computed = len(seq.tokens)
        self.bm.truncate(key, len(seq.tokens))

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def free(self, data):
        key = data.draw(st.sampled_from(sorted(self.live)))
        del self.live[key]
        self.bm.free(key)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def preempt(self, data):
        """Free, then allocate again for prompt + generated tokens (recompute)."""
        key = data.draw(st.sampled_from(sorted(self.live)))
        seq = self.live.pop(key)
        self.bm.free(key)
        self.admit(key, seq.tokens)

    @rule()
    def reset(self):
        self.bm.reset()
        self.live.clear()

    @invariant()
    def tables_and_refcounts_agree(self):
        bm, size = self.bm, self.bm.block_size
        assert set(bm._tables) == set(self.live)
        for b in range(bm.num_blocks):
            assert bm._refs[b] == self.owners(b)
        free = set(bm._free_plain) | set(bm._free_cached)
        assert len(free) == len(bm._free_plain) + len(bm._free_cached) == bm.num_free
        assert free == {b for b in range(bm.num_blocks) if bm._refs[b] == 0}
        assert bm.num_free + bm.num_used == bm.num_blocks
        assert set(bm._free_cached) <= set(bm._content_of) and not set(bm._free_plain) & set(bm._content_of)
        for key, seq in self.live.items():
            table = bm._tables[key]
            assert len(table) == -(-len(seq.tokens) // size)
            assert len(set(table)) == len(table)
            for block in table[seq.computed // size :]:  # blocks it will still write
                assert bm._refs[block] == 1 and block not in bm._content_of
            for block in table:
                if bm._refs[block] > 1:
                    assert block in bm._content_of

    @invariant()
    def cache_index_is_consistent(self):
        bm = self.bm
        if not bm.enable_prefix_caching:
            assert not bm._contents and bm.hit_tokens == 0
        held = {b for c in bm._contents.values() for b in c.holders}
        assert held == set(bm._content_of)
        for key, content in bm._contents.items():
            assert content.key == key and content.holders
            assert all(bm._content_of[b] is content for b in content.holders)
            for b in content.holders:  # a registered block holds its content's tokens
                assert tuple(self.kv[b][i][-1] for i in range(bm.block_size)) == key[1]
        assert bm.hit_tokens <= bm.query_tokens


BlockTables.TestCase.settings = settings(
    max_examples=200,
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_block_tables = BlockTables.TestCase


def test_a_cache_salt_shares_blocks_only_with_the_same_salt():
    """vLLM's cache_salt: a salted prompt neither hits nor leaves hits for unsalted prompts or
    other salts; the same salt hits as unsalted prompts hit each other."""
    blocks = BlockManager(num_blocks=16, block_size=4)
    prompt = list(range(1, 14))  # 3 full blocks and a token
    assert blocks.allocate("plain", prompt) == 0
    blocks.computed("plain", prompt, len(prompt))
    assert blocks.allocate("tenant-a", prompt, salt="a") == 0  # no hit on the unsalted blocks
    blocks.computed("tenant-a", prompt, len(prompt))
    assert blocks.allocate("tenant-b", prompt, salt="b") == 0
    assert blocks.allocate("tenant-a-again", prompt, salt="a") == 12
    assert blocks.allocate("plain-again", prompt) == 12


def test_any_salt_string_hashes_even_a_lone_surrogate():
    """The APIs refuse a lone surrogate in cache_salt; were one to reach the block manager anyway,
    its digest is still computed (a UnicodeEncodeError in the engine loop failed every request)."""
    blocks = BlockManager(num_blocks=16, block_size=4)
    prompt = list(range(1, 10))
    assert blocks.allocate("odd", prompt, salt="tenant-\ud800") == 0
    blocks.computed("odd", prompt, len(prompt))
    assert blocks.allocate("odd-again", prompt, salt="tenant-\ud800") == 8
    assert blocks.allocate("other", prompt, salt="tenant-\udc00") == 0
