"""A request that asks for prompt logprobs computes its prompt from position 0: its sequence takes
no prefix-cache hit (BlockManager.allocate reuse=False, the placement's check agreeing), scores its
prompt until every position has an entry, and reports them once, with its first token."""

from agent.contract.prompt_logprobs import PromptLogprob
from agent.contract.sampling import SamplingParams
from scheduler.block_manager import BlockManager
from scheduler.sequence import Sequence


def test_no_hit_without_reuse_and_its_blocks_still_join_the_cache():
    bm = BlockManager(8, 4)
    prompt = list(range(10))
    assert bm.allocate("a", prompt) == 0
    bm.computed("a", prompt, len(prompt))
    # a hit is there to take, and reuse False takes none: it needs fresh blocks for all three
    assert bm.blocks_needed(prompt) == 1 and bm.blocks_needed(prompt, reuse=False) == 3
    assert bm.can_allocate(prompt, reuse=False)
    assert bm.allocate("b", prompt, reuse=False) == 0
    assert not set(bm.table("a")) & set(bm.table("b"))
    bm.computed("b", prompt, len(prompt))
    bm.free("a")
    assert bm.allocate("c", prompt) == 8  # the cache still serves the prefix to others
    # with too few free blocks for a whole prompt, reuse False is refused where a hit would fit
    assert bm.allocate("d", list(range(50, 52)), reuse=False) == 0  # one block: num_free - 1 left
    while bm.num_free > 2:
        assert bm.allocate(f"fill{bm.num_free}", [99], reuse=False) == 0
    assert bm.blocks_needed(prompt) == 1 and bm.can_allocate(prompt)
    assert not bm.can_allocate(prompt, reuse=False) and bm.allocate("e", prompt, reuse=False) is None


def test_a_sequence_scores_its_prompt_until_complete_and_reports_once():
    asked = Sequence("r", [1, 2, 3, 4], SamplingParams(prompt_logprobs=2), 4)
    assert asked.scoring_prompt
    asked.prompt_logprobs[:] = [PromptLogprob(-1.0, 1)] * 3  # positions 1..3
    assert not asked.scoring_prompt
    assert asked.report() is None  # nothing generated yet: nothing reported
    asked.output.append(7)
    assert asked.report().prompt_logprobs == (PromptLogprob(-1.0, 1),) * 3
    asked.output.append(8)
    assert asked.report().prompt_logprobs is None  # once
    plain = Sequence("p", [1, 2, 3], SamplingParams(), 4)
    assert not plain.scoring_prompt
    plain.output.append(5)
    assert plain.report().prompt_logprobs is None
    assert not Sequence(
        "one", [1], SamplingParams(prompt_logprobs=0), 4
    ).scoring_prompt  # no position to score
