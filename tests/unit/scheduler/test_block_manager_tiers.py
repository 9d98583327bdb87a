"""BlockManager's second tier (tiered=True): an evicted content's last block is queued to spill under
its digest, a lookup goes on in the tier where the pool's run ends, those blocks are queued to
restore and count as hits, and only computed() makes them hit-able; digests are the same in a new
manager (a restart) and differ per cache salt. The index of the tier's blocks holds what the tier
holds (the agent's reports of what it let go) and never more than its capacity."""

import numpy as np

from agent.kv_tiers import KVLayout, KVTierStore
from scheduler.block_manager import BlockManager

SIZE = 4


def run(bm: BlockManager, key, tokens, salt=None) -> int:
    hit = bm.allocate(key, tokens, salt)
    assert hit is not None
    bm.computed(key, tokens, len(tokens))
    return hit


def digests(bm: BlockManager, key) -> list[str]:
    return [bm._content_of[b].digest for b in bm.table(key) if b in bm._content_of]


PROMPT = list(range(100, 113))  # three full blocks and one position
OTHER = list(range(200, 216))  # four full blocks: with a pool of 4 it evicts all of PROMPT's


def evicted_prompt(bm: BlockManager) -> list[str]:
    """PROMPT computed, freed, then pushed out of the pool by OTHER; returns PROMPT's digests."""
    run(bm, "p", PROMPT)
    names = digests(bm, "p")
    bm.free("p")
    run(bm, "o", OTHER)
    bm.free("o")
    return names


def test_an_evicted_block_is_spilled_under_its_digest_before_it_is_reused():
    bm = BlockManager(4, SIZE, tiered=True)
    names = evicted_prompt(bm)
    assert len(names) == 3
    # PROMPT held blocks 0..2; OTHER took the plain block 3, then those, the tail first (LRU)
    assert bm.take_spills() == [(2, names[2]), (1, names[1]), (0, names[0])]
    assert bm.take_spills() == [] and set(bm.tier_keys) == set(names)


def test_without_the_tier_nothing_is_spilled_or_restored():
    bm = BlockManager(4, SIZE)
    evicted_prompt(bm)
    assert bm.take_spills() == [] and bm.allocate("again", PROMPT) == 0 and bm.take_restores() == []


def test_a_block_another_holder_keeps_is_not_spilled():
    bm = BlockManager(8, SIZE, tiered=True)
    run(bm, "p", PROMPT)
    run(bm, "q", PROMPT)  # hits p's blocks: one holder each, in use
    bm.free("p")
    run(bm, "o", OTHER)
    assert bm.take_spills() == []


def test_a_lookup_goes_on_in_the_tier_and_restores_count_as_hits():
    bm = BlockManager(4, SIZE, tiered=True)
    names = evicted_prompt(bm)
    bm.take_spills()
    assert bm.allocate("again", PROMPT) == 3 * SIZE  # the last position is always computed
    restores = bm.take_restores()
    assert restores == list(zip(names, bm.table("again")[:3]))
    assert bm.tier_hit_tokens == 3 * SIZE and bm.hit_tokens == 3 * SIZE
    # not hit-able before the step that restores them succeeded
    assert bm.blocks_needed(PROMPT) == 4 and digests(bm, "again") == []
    bm.computed("again", PROMPT, len(PROMPT))
    assert digests(bm, "again") == names


def test_the_pool_run_then_the_tier_run():
    bm = BlockManager(6, SIZE, tiered=True)
    run(bm, "p", PROMPT)
    names = digests(bm, "p")
    bm.free("p")  # tail first: blocks 2, 1, 0 in LRU order
    run(bm, "o", [7] * 8)  # takes the free plain blocks 3, 4: nothing evicted
    run(bm, "o2", [9] * 12)  # takes block 5, then evicts 2 and 1: PROMPT's first block stays
    assert [d for _, d in bm.take_spills()] == [names[2], names[1]]
    bm.free("o")
    bm.free("o2")
    assert bm.allocate("again", PROMPT) == 3 * SIZE
    assert bm.table("again")[0] == 0  # the pool's hit
    assert [d for d, _ in bm.take_restores()] == names[1:]
    assert bm.tier_hit_tokens == 2 * SIZE


def test_a_failed_restore_is_not_looked_up_again():
    bm = BlockManager(4, SIZE, tiered=True)
    names = evicted_prompt(bm)
    bm.restore_failed(names[1:2])
    assert bm.allocate("again", PROMPT) == SIZE  # the run stops at the lost block
    assert [d for d, _ in bm.take_restores()] == names[:1]


def test_digests_survive_a_restart_and_are_independent_of_history():
    first = BlockManager(4, SIZE, tiered=True)
    names = evicted_prompt(first)
    restarted = BlockManager(16, SIZE, tiered=True)
    run(restarted, "x", [1, 2, 3, 4, 5])  # another history: other serial numbers
    restarted.seed_tier(names)
    assert restarted.allocate("again", PROMPT) == 3 * SIZE
    assert [d for d, _ in restarted.take_restores()] == names
    run(restarted, "fresh", PROMPT + [1])
    assert digests(restarted, "fresh")[:3] == names


def test_a_salted_chain_has_its_own_digests():
    bm = BlockManager(4, SIZE, tiered=True)
    names = evicted_prompt(bm)
    assert bm.allocate("salted", PROMPT, "tenant-a") == 0 and bm.take_restores() == []
    bm.computed("salted", PROMPT, len(PROMPT))
    salted = digests(bm, "salted")
    assert len(salted) == 3 and not set(salted) & set(names)
    bm.free("salted")
    other = BlockManager(4, SIZE, tiered=True)
    other.seed_tier(salted)
    assert other.allocate("b", PROMPT, "tenant-b") == 0
    other.free("b")
    assert other.allocate("a", PROMPT, "tenant-a") == 3 * SIZE


def test_reset_forgets_the_tier_until_reseeded():
    bm = BlockManager(4, SIZE, tiered=True)
    names = evicted_prompt(bm)
    bm.reset()
    assert bm.allocate("again", PROMPT) == 0
    bm.free("again")
    bm.seed_tier(names)
    assert bm.allocate("again2", PROMPT) == 3 * SIZE


def test_drop_cache_forgets_the_pool_and_the_tier_index_but_keeps_what_sequences_use():
    bm = BlockManager(4, SIZE, tiered=True)
    names = evicted_prompt(bm)  # PROMPT in the tier, OTHER cached in the pool
    bm.take_spills()
    # restores queued for a sequence that counts on them (3 of the 4 blocks: one of OTHER's stays)
    assert bm.allocate("again", PROMPT[:9]) == 2 * SIZE
    queued = list(bm.restores)
    bm.spills.append((3, "f" * 64))  # one not yet sent
    cached = bm.num_cached
    assert cached > 0 and bm.drop_cache() == cached
    assert bm.num_cached == 0 and set(bm.tier_keys) == set() and bm.take_spills() == []
    assert [d for d, _ in bm.take_restores()] == [d for d, _ in queued] == names[:2]
    assert bm.num_free == 4 - len(bm.table("again")) == 1
    bm.computed("again", PROMPT[:9], 9)  # the restore succeeded: registered from here on
    bm.free("again")
    assert bm.allocate("other", OTHER) == 0 and bm.take_restores() == []  # neither pool nor tier
    bm.free("other")
    assert bm.allocate("prompt", PROMPT[:9]) == 2 * SIZE  # what the sequence computed after the drop


def test_write_through_saves_each_content_once_as_it_is_computed():
    bm = BlockManager(8, SIZE, tiered=True, write_through=True)
    run(bm, "p", PROMPT)
    names = digests(bm, "p")
    # the three full blocks, queued as computed (the last position's block is not full: never)
    assert bm.take_spills() == list(zip(bm.table("p")[:3], names)) and set(bm.tier_keys) == set(names)
    run(bm, "q", PROMPT)  # a pool hit: nothing new to save
    assert bm.take_spills() == []

    small = BlockManager(4, SIZE, tiered=True, write_through=True)
    evicted_prompt(small)  # PROMPT saved, then evicted by OTHER: spilled again (the tier may have let it go)
    spilled = [d for _, d in small.take_spills()]
    assert spilled.count(names[0]) == 2 and len(spilled) == 3 + 3 + 4
    assert small.allocate("again", PROMPT) == 3 * SIZE and len(small.take_restores()) == 3
    small.take_spills()  # OTHER's, evicted for it
    small.computed("again", PROMPT, len(PROMPT))
    assert small.take_spills() == []  # restored contents are in the tier already


def test_without_write_through_only_evictions_spill():
    bm = BlockManager(8, SIZE, tiered=True)
    run(bm, "p", PROMPT)
    assert bm.take_spills() == [] and set(bm.tier_keys) == set()


# The stream: unique prompts of four full blocks each through a pool of 64 blocks (12,000
# digests after 3,000 prompts when nothing is ever forgotten)
STREAM = 3000
LAYOUT = KVLayout(
    layers=1, kv_heads=1, head_dim=4, row_width=4, block_size=SIZE, dtype="float16", kernel_layout="paged"
)


def unique_prompt(i: int) -> list[int]:
    return list(range(i * 17, i * 17 + 17))


def serve(bm: BlockManager, key, tokens, tier: KVTierStore | None) -> int:
    """One prompt as the engine runs it: allocated, its step (the agent's tier moves first:
    spills, restores, then the report the reply carries), computed, freed. Returns the size of
    the tier index as the step left it."""
    bm.allocate(key, tokens)
    if tier is not None:
        for _, digest in bm.take_spills():
            tier.put(digest, np.zeros(LAYOUT.shape, LAYOUT.dtype))
        restores = bm.take_restores()
        failed = [d for (d, _), kv in zip(restores, tier.get_many([d for d, _ in restores])) if kv is None]
        bm.restore_failed(failed)
        bm.tier_evicted(tier.report(0.0).evicted_keys)
    indexed = len(bm.tier_keys)
    bm.computed(key, tokens, len(tokens))  # its blocks are saved (write-through) in the next step
    bm.free(key)
    return indexed


def test_the_tier_index_holds_what_the_tier_holds_over_a_stream_of_unique_prompts():
    tier = KVTierStore(LAYOUT, "model", host_bytes=256 * LAYOUT.nbytes)
    bm = BlockManager(64, SIZE, tiered=True, write_through=True)  # no cap: the reports alone
    for i in range(STREAM):
        assert serve(bm, i, unique_prompt(i), tier) <= tier.capacity_blocks == 256
        if i % 100 == 0:
            assert set(bm.tier_keys) - tier.keys() == {d for _, d in bm.spills}  # those not yet sent
    # what the tier still holds is still found there
    assert bm.allocate("again", unique_prompt(STREAM - 1)) == 4 * SIZE


def digests_of(tokens: list[int]) -> set[str]:
    """A prompt's digests (they depend on its tokens alone)."""
    probe = BlockManager(8, SIZE, tiered=True)
    run(probe, "probe", tokens)
    return set(digests(probe, "probe"))


def test_the_tier_index_never_outgrows_the_tiers_capacity_when_reports_are_lost():
    bm = BlockManager(64, SIZE, tiered=True, write_through=True, tier_capacity=256)
    largest = 0
    for i in range(STREAM):
        serve(bm, i, unique_prompt(i), None)  # the agent's reports never arrive
        if i == 40:  # an early prompt hit again (restored from the tier): kept past its age
            assert bm.allocate("early", unique_prompt(0)) == 4 * SIZE
            bm.free("early")
        if i == 80:  # the index is full: the first prompt, restored at 40, is kept; the second went
            indexed = set(bm.tier_keys)
            assert digests_of(unique_prompt(0)) <= indexed and not digests_of(unique_prompt(1)) & indexed
        largest = max(largest, len(bm.tier_keys))
    assert largest == 256
    assert digests_of(unique_prompt(STREAM - 1)) <= set(bm.tier_keys)  # the most recent are kept
    assert not digests_of(unique_prompt(STREAM - 100)) & set(bm.tier_keys)  # the least recent went


def test_a_restored_digest_outlives_those_indexed_before_its_restore():
    bm = BlockManager(8, SIZE, tiered=True, tier_capacity=6)
    older, newer = [f"{i:064x}" for i in range(3)], [f"{i:064x}" for i in range(3, 6)]
    bm.seed_tier(sorted(digests_of(PROMPT)))
    bm.seed_tier(older)  # indexed after PROMPT's
    assert bm.allocate("again", PROMPT) == 3 * SIZE  # restored: the most recently used now
    bm.seed_tier(newer)  # over the capacity: the least recently used go, older's, not PROMPT's
    assert set(bm.tier_keys) == digests_of(PROMPT) | set(newer)
