"""ModelRunner over block tables the server hands out (protocol v4): prompts longer than the
largest prefill bucket, prompts in chunks, a prefix read from another sequence's blocks, the
recompute of a preempted sequence and KV transfers of many pieces all give the tokens of the
independent numpy reference, and tables that do not fit are refused before anything runs."""

import numpy as np
import pytest

import reference_numpy as ref
import runner_calls as calls
from agent.contract.sampling import SamplingParams
from agent.contract.step import StepChunk, StepRequest
from agent.kv_transfer import export_kv, import_kv
from agent.model.formats import load_checkpoint
from agent.runner import ModelRunner, RunnerError
from config.schema import RuntimeSection

# max_seq_len 160 in blocks of 16 (10 a table, 40 in the pool); the largest bucket (32) is far
# below a long prompt, so every long call runs in pieces
PAGED_RUNTIME = RuntimeSection(
    num_slots=4,
    max_seq_len=160,
    block_size=16,
    prefill_buckets=[16, 32],
    decode_batch_buckets=[1, 2, 4],
    attend_buckets=[160],
    compile_cache_dir=None,
)
GREEDY = SamplingParams()
SEEDED = SamplingParams(do_sample=True, top_k=20, temperature=0.9, repetition_penalty=1.2, seed=5)


@pytest.fixture(scope="module")
def runners(tiny_llama_dir) -> tuple[ModelRunner, ModelRunner]:
    """Two runners (two caches: a prefill and a decode agent's)."""
    checkpoint = load_checkpoint(tiny_llama_dir)
    return ModelRunner.from_checkpoint(checkpoint, PAGED_RUNTIME), ModelRunner.from_checkpoint(
        checkpoint, PAGED_RUNTIME
    )


@pytest.fixture
def runner(runners, release_all) -> ModelRunner:
    release_all(runners[0])
    release_all(runners[1])
    return runners[0]


@pytest.fixture(scope="module")
def reference(tiny_llama_dir) -> ref.RefModel:
    return ref.load_hf_reference(tiny_llama_dir)


def shuffled(n: int, seed: int, pool: int = 40) -> list[list[int]]:
    """n disjoint tables of 10 blocks each, from a permutation of the pool."""
    blocks = np.random.default_rng(seed).permutation(pool)[: n * 10]
    return [blocks[i * 10 : (i + 1) * 10].tolist() for i in range(n)]


def prompt(n: int, seed: int = 0) -> list[int]:
    return np.random.default_rng(seed).integers(3, 250, n).tolist()


def decode_n(runner: ModelRunner, slot: int, table: list[int], n: int) -> list[int]:
    return [calls.decode(runner, [slot], [table])[0] for _ in range(n)]


def test_a_prompt_five_buckets_long_matches_the_reference(runner, reference):
    ids = prompt(150)
    (table,) = shuffled(1, seed=1)
    first = calls.prefill(runner, 0, ids, GREEDY, table)  # positions in pieces of 32, the last of 22
    assert [first, *decode_n(runner, 0, table, 8)] == ref.greedy(reference, ids, 9)
    assert runner.slot_table.slot_length(0) == 158


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_chunks_a_prefix_hit_and_a_recompute_give_the_tokens_of_one_call(runner, params):
    ids = prompt(90, seed=2)
    whole_table, chunked_table, shared_table, recompute_table = shuffled(4, seed=3)
    whole = [calls.prefill(runner, 0, ids, params, whole_table), *decode_n(runner, 0, whole_table, 6)]

    calls.prefill_chunk(runner, 1, ids[:37], chunked_table, 0)
    calls.prefill_chunk(runner, 1, ids[:61], chunked_table, 37)
    chunked = [
        calls.prefill(runner, 1, ids, params, chunked_table, 61),
        *decode_n(runner, 1, chunked_table, 6),
    ]
    assert chunked == whole

    # The first 4 blocks (64 positions) read from the chunked sequence's blocks: a prefix-cache hit.
    shared_table[:4] = chunked_table[:4]
    hit = [calls.prefill(runner, 2, ids, params, shared_table, 64), *decode_n(runner, 2, shared_table, 6)]
    assert hit == whole

    # A preempted sequence: its blocks lost, recomputed elsewhere (prompt and output but the pending
    # token), it goes on with its own sampler as if nothing happened.
    calls.prefill(runner, 3, ids, params, recompute_table)
    before = decode_n(runner, 3, recompute_table, 3)
    computed = ids + [whole[0], *before[:-1]]
    fresh = shuffled(1, seed=9)[0]
    calls.prefill_chunk(runner, 3, computed, fresh, 0)
    assert [whole[0], *before, *decode_n(runner, 3, fresh, 3)] == whole


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_kv_of_many_pieces_moves_to_other_blocks_and_decodes_the_same(runners, runner, params):
    sender, receiver = runners
    ids = prompt(120, seed=4)
    home_table, moved_table = shuffled(2, seed=5)
    first = calls.prefill(sender, 0, ids, params, home_table)
    blocks, _, state = export_kv(sender, 0)
    assert blocks.shape[2] == 120 and state["length"] == 120
    at_home = decode_n(sender, 0, home_table, 8)
    import_kv(receiver, 2, blocks, state, moved_table[:8])  # 8 blocks: the prompt and the next 7
    assert state["next_token"] == first and decode_n(receiver, 2, moved_table[:8], 8) == at_home


def test_tables_that_do_not_fit_are_refused(runner):
    ids = prompt(40)
    with pytest.raises(RunnerError, match="does not cover 40 positions"):
        calls.prefill(runner, 0, ids, GREEDY, [1, 2])
    with pytest.raises(RunnerError, match=r"entries lie in 0..39"):
        calls.prefill(runner, 0, ids, GREEDY, [1, 2, 40])
    with pytest.raises(RunnerError, match="at most 10 integer blocks"):
        calls.prefill(runner, 0, ids, GREEDY, list(range(11)))
    assert runner.slots == {}
    calls.prefill_chunk(runner, 1, ids[:20], [4, 5])
    with pytest.raises(RunnerError, match="start..39 after the 20 the slot holds, not from 30"):
        calls.prefill(runner, 1, ids, GREEDY, [4, 5, 6], start=30)  # positions 20..29 would be missing
    with pytest.raises(RunnerError, match="has not finished its prompt"):
        calls.decode(runner, [1], [[4, 5]])
    calls.prefill(runner, 0, ids, GREEDY, [1, 2, 3])
    with pytest.raises(RunnerError, match=r"entries lie in 0..39"):
        calls.decode(runner, [0], [[1, -1, 3]])  # -1 pads only past the held blocks
    with pytest.raises(RunnerError, match="does not cover 49 positions"):
        for _ in range(10):  # position 48 needs a fourth block
            calls.decode(runner, [0], [[1, 2, 3]])
    assert runner.slot_table.slot_length(0) == 48


def mixed_run(runner: ModelRunner, ids: list[list[int]], tables: list[list[int]], params, mixed: bool):
    """Slots 0 and 1 decode while slot 2's prompt arrives in three chunks and slot 3's in one: as
    mixed steps, or the same calls one by one -> each slot's tokens. The first step's chunk samples
    nothing (its logit rows are the decode rows' 2, its tables 3), the second's samples after one
    that does not."""
    out: list[list[int]] = [[calls.prefill(runner, s, ids[s], params, tables[s])] for s in (0, 1)]
    out += [[], []]
    steps = [
        ([0, 1], [StepChunk(2, ids[2][:4], tables[2], 0, None)]),
        (
            [0, 1],
            [
                StepChunk(2, ids[2][:7], tables[2], 4, None),
                StepChunk(3, ids[3], tables[3], 0, params),
            ],
        ),
        ([0, 1, 3], [StepChunk(2, ids[2], tables[2], 7, params)]),
    ]
    for slots, chunks in steps:
        if mixed:
            decoded, firsts = calls.step(runner, slots, [tables[s] for s in slots], chunks)
            tokens = [only for (only,) in decoded]
        else:
            tokens = calls.decode(runner, slots, [tables[s] for s in slots])
            firsts = [
                calls.prefill(runner, c.slot, c.tokens, c.sampling, c.table, c.start)
                if c.sampling is not None
                else calls.prefill_chunk(runner, c.slot, c.tokens, c.table, c.start)
                for c in chunks
            ]
        for slot, token in zip(slots, tokens):
            out[slot].append(token)
        for chunk, first in zip(chunks, firsts):
            assert (first is None) == (not chunk.sample)
            if first is not None:
                out[chunk.slot].append(first)
    for _ in range(4):
        for slot, token in enumerate(calls.decode(runner, [0, 1, 2, 3], tables)):
            out[slot].append(token)
    return out


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_mixed_steps_give_the_tokens_of_separate_calls(runners, runner, reference, params):
    """A decode and prompt chunks in one call (rows of four sequences, each through its own block
    table): greedy, the reference's tokens; seeded, the tokens of the same calls one by one."""
    assert runner.mixed_rows == 16  # the prefill bucket that holds the largest decode batch (4) + 1
    ids = [prompt(20, seed=10), prompt(33, seed=11), prompt(12, seed=12), prompt(5, seed=13)]
    tables = shuffled(4, seed=7)
    mixed = mixed_run(runner, ids, tables, params, mixed=True)
    if params is GREEDY:
        assert mixed == [ref.greedy(reference, ids[s], len(mixed[s])) for s in range(4)]
    else:
        assert mixed == mixed_run(runners[1], ids, tables, params, mixed=False)


def test_a_mixed_step_that_does_not_fit_changes_nothing(runner, reference):
    ids, tables = [prompt(20, seed=20), prompt(30, seed=21)], shuffled(2, seed=8)
    first = calls.prefill(runner, 0, ids[0], GREEDY, tables[0])
    too_long = StepChunk(1, ids[1], tables[1], 0, GREEDY)  # 1 + 30 rows > 16
    with pytest.raises(RunnerError, match="exceeds 16 rows"):
        calls.step(runner, [0], [tables[0]], [too_long])
    bad_table = StepChunk(1, ids[1][:10], [999], 0, GREEDY)
    with pytest.raises(RunnerError):
        calls.step(runner, [0], [tables[0]], [bad_table])
    assert runner.slot_table.slot_length(0) == 20 and 1 not in runner.slots
    with pytest.raises(RunnerError, match="names a slot twice"):
        calls.step(runner, [0], [tables[0]], [StepChunk(0, ids[0], tables[0], 0, None)])
    assert [first, *decode_n(runner, 0, tables[0], 2)] == ref.greedy(reference, ids[0], 3)


# ------------------------------------------------------------------------------ speculative decoding


def speculated(runner: ModelRunner, ids: list[int], table: list[int], params, proposals, steps: int):
    """A sequence decoded in steps whose proposals come from `proposals(tokens so far)` (verified in
    one step each, the table covering them) -> its tokens and the number of tokens each step gave."""
    tokens = [calls.prefill(runner, 0, ids, params, table)]
    gave = []
    for _ in range(steps):
        drafts = {0: proposals(ids + tokens)} if proposals(ids + tokens) else {}
        decoded, _ = (
            calls.step(runner, [0], [table], [], drafts=drafts)
            if drafts
            else ([calls.decode(runner, [0], [table])], [])
        )
        tokens += decoded[0]
        gave.append(len(decoded[0]))
    return tokens, gave


def test_proposals_kept_and_rejected_give_exactly_the_greedy_tokens(runner, reference):
    """Greedy verification: proposals that are the reference's next tokens are kept (a step then
    gives them and one more), wrong ones are not (from the first wrong one on); either way the
    sequence's tokens are the reference's, the rejected positions' KV written over later."""
    ids, table = prompt(21, seed=30), shuffled(1, seed=9)[0]
    want = ref.greedy(reference, ids, 40)

    def right(known: list[int]) -> list[int]:  # the next 3 tokens of the reference's answer
        done = len(known) - len(ids)
        return want[done : done + 3]

    def half_right(known: list[int]) -> list[int]:  # the next one, then a wrong one
        done = len(known) - len(ids)
        return [want[done], (want[done + 1] + 1) % 250] if done + 1 < len(want) else []

    got, gave = speculated(runner, ids, table, GREEDY, right, 8)
    assert got == want[: len(got)] and max(gave) == 4 and len(got) > 8
    runner.release(0)
    got, gave = speculated(runner, ids, table, GREEDY, half_right, 8)
    assert got == want[: len(got)] and set(gave) == {2}


def test_verified_steps_beside_prompt_chunks_and_plain_rows(runners, runner, reference):
    """Slot 0 verifies 2 proposals while slot 1 decodes plainly and slot 2's first prompt chunk
    arrives, in one call (4 rows of logits, the largest decode bucket): every slot gets the tokens
    it gets alone."""
    ids = [prompt(20, seed=40), prompt(25, seed=41), prompt(9, seed=42)]
    tables = shuffled(3, seed=10)
    want = [ref.greedy(reference, p, 8) for p in ids]
    first = [calls.prefill(runner, s, ids[s], GREEDY, tables[s]) for s in (0, 1)]
    decoded, firsts = calls.step(
        runner, [0, 1], tables[:2], [StepChunk(2, ids[2][:5], tables[2], 0, None)], drafts={0: want[0][1:3]}
    )
    assert [first[0], *decoded[0]] == want[0][:4] and [first[1], *decoded[1]] == want[1][:2]
    assert firsts == [None] and calls.prefill(runner, 2, ids[2], GREEDY, tables[2], start=5) == want[2][0]
    with pytest.raises(RunnerError, match="proposals for slot 3"):
        calls.step(runner, [0, 1], tables[:2], [], drafts={3: [5]})
    with pytest.raises(RunnerError, match="1..16 tokens"):
        calls.step(runner, [0, 1], tables[:2], [], drafts={0: list(range(5, 22))})
    assert runner.slot_table.slot_length(0) == 20 + 3  # a refused step changes nothing


def test_sampled_verification_keeps_the_targets_distribution():
    """Rejection sampling of certain proposals: over many draws with a fixed seed, the first token
    of a step has the target's distribution whatever is proposed (a likely token, an unlikely one,
    one outside top-k), within a few standard errors."""
    from agent.sampling import SlotSampler

    vocab, draws = 8, 20_000
    logits = np.log(np.array([0.4, 0.25, 0.15, 0.1, 0.05, 0.03, 0.015, 0.005]))
    for params in (SamplingParams(do_sample=True, seed=1), SamplingParams(do_sample=True, seed=2, top_k=4)):
        target = np.exp(logits[: params.top_k or vocab])
        target = np.pad(target / target.sum(), (0, vocab - len(target)))
        for proposal in (0, 3, 6):
            sampler = SlotSampler(params, [], vocab)
            counts = np.zeros(vocab)
            for _ in range(draws):
                counts[sampler.verify(np.stack([logits, logits]), [proposal])[0]] += 1
            freq = counts / draws
            assert np.all(np.abs(freq - target) < 5 * np.sqrt(target * (1 - target) / draws) + 1e-9), (
                params,
                proposal,
                freq,
                target,
            )


def test_a_bug_in_one_rows_choice_is_that_sequences_fault(runner, reference, monkeypatch):
    """One sequence's sampler raises something no sampler should (a bug: caused here by a patch, as
    nothing from outside can): that sequence gets NO_TOKEN and an internal fault, the other
    sequence of the same step its own token."""
    from agent.contract.sampling import NO_TOKEN
    from agent.sampling import SlotSampler

    ids, tables = [prompt(12, seed=50), prompt(14, seed=51)], shuffled(2, seed=11)
    sampled = SamplingParams(do_sample=True, seed=3, logprobs=1)  # the host path: choose_from_logits
    calls.prefill(runner, 0, ids[0], sampled, tables[0])
    first = calls.prefill(runner, 1, ids[1], GREEDY, tables[1])
    broken = runner.slots[0].sampler

    def choose(self, *args, **kwargs):
        if self is broken:
            raise IndexError("a bug")
        return original(self, *args, **kwargs)

    original = SlotSampler.choose_from_logits
    monkeypatch.setattr(SlotSampler, "choose_from_logits", choose)
    (broken_token,), (token,) = runner.execute(StepRequest(slots=[0, 1], tables=tables)).decoded
    assert (
        broken_token.token == NO_TOKEN
        and broken_token.fault.kind == "internal"
        and "IndexError: a bug" in broken_token.fault.message
    )
    assert token.fault is None
    assert token.token == ref.greedy(reference, ids[1], 2)[1] and first == ref.greedy(reference, ids[1], 1)[0]


def drafted(
    target: ModelRunner, drafter, slot: int, ids: list[int], table: list[int], params, k: int, steps: int
):
    """A sequence decoded in steps whose proposals are the draft model's (k a step) -> its tokens
    and the tokens each step gave."""
    tokens, gave = [calls.prefill(target, slot, ids, params, table)], []
    for _ in range(steps):
        drafts = drafter.propose({slot: k}, {slot: table})
        decoded, _ = calls.step(target, [slot], [table], [], drafts=drafts)
        tokens += decoded[0]
        gave.append(len(decoded[0]))
    return tokens, gave


def test_the_model_as_its_own_draft_has_every_proposal_kept(runners, runner, reference, release_all):
    """The draft model is the model itself (its own runner and cache): each step keeps the k
    proposals and gives one more, and the tokens are the reference's; a slot taken anew with
    another sequence is followed from its first position, not from the last one's KV."""
    from agent.drafter import Drafter

    release_all(runners[1])
    drafter = Drafter(runners[1], runner)
    for seed in (60, 61):
        ids, table = prompt(17, seed=seed), shuffled(1, seed=seed)[0]
        got, gave = drafted(runner, drafter, 0, ids, table, GREEDY, 3, 6)
        assert got == ref.greedy(reference, ids, len(got)) and gave == [4] * 6
        runner.release(0)


def test_another_draft_model_changes_no_token(runner, reference, tmp_path):
    """A smaller model of the same vocabulary (other weights: most proposals rejected) as the
    draft: greedy tokens are the reference's; sampled sequences verify its proposals too (their
    distribution: test_sampled_verification_keeps_the_targets_distribution)."""
    from agent.drafter import Drafter, check_vocabularies
    from agent.model.formats import load_checkpoint
    from tiny_models import write_tiny_checkpoint

    small = write_tiny_checkpoint(tmp_path / "draft", seed=9, layers=1, hidden=32, heads=2, kv_heads=1)
    check_vocabularies(small, small)
    drafter = Drafter(ModelRunner.from_checkpoint(load_checkpoint(small), runner.runtime), runner)
    ids, table = prompt(23, seed=70), shuffled(1, seed=12)[0]
    got, gave = drafted(runner, drafter, 1, ids, table, GREEDY, 3, 8)
    assert got == ref.greedy(reference, ids, len(got)) and all(1 <= n <= 4 for n in gave)
    runner.release(1)
    got, _ = drafted(runner, drafter, 1, ids, table, SEEDED, 3, 4)
    assert len(got) >= 5 and all(0 <= t < 400 for t in got)


def test_a_draft_model_of_another_vocabulary_is_refused_naming_it(tiny_llama_dir, tmp_path):
    from agent.drafter import DraftMismatch, check_vocabularies
    from tiny_models import write_tiny_checkpoint, write_tokenizer

    other = write_tiny_checkpoint(tmp_path / "other", seed=3)
    write_tokenizer(other, vocab_size=300)
    with pytest.raises(DraftMismatch, match="300 tokens, the model's 400"):
        check_vocabularies(tiny_llama_dir, other)
