"""Qwen3.5's Gated DeltaNet layers as the runner serves them (agent/kernels/gated_delta.h in the fused
kernel, each sequence's state kept in its slot) against the independent numpy reference
(tests/support/reference_numpy.py). The reference computes the gated delta rule in transformers'
chunked form (chunks of 64 solved at once, then a scan over chunks) where the kernel runs it token by
token, so the two agree only where both are right; the first test holds the chunked form itself to the
plain recurrence.

The model is a tiny qwen35 GGUF as llama.cpp's converter writes it (hf_reference: three DeltaNet
layers then a gated attention layer, 4 value heads over 2 key heads), served in float32 against the
float64 reference: logits agree to TOLERANCE of the largest |logit|. Its decays are strong (A in
[1, 8]): a state is forgotten within a few tokens, so the tests compare every row of a prompt (its
prompt logprobs' logits) or short chunks, where the state a row starts from still shows. So do the
tests of speculative decoding's held runs (a verify step's rows run on a copy of the state, the rows
kept replayed by the slot's next call) and of prefix caching's state snapshots: they compare the rows
right after the event."""

import copy

import numpy as np
import pytest
from conftest import DEFAULT_RUNTIME

import hf_reference as hf
import reference_numpy as ref
import runner_calls as calls
from agent.contract.sampling import SamplingParams
from agent.model.formats import load_checkpoint
from agent.runner import ModelRunner
from agent.slots import RunnerError

GREEDY = SamplingParams()
TOLERANCE = 1e-3  # of the largest |logit|; float32 against float64: at most 2e-5 measured
SCORED = (1, None)  # prompt logprobs: the prefill graph returns every row's logits
# Speculation's most proposals 3: a verify step of them (4 rows of logits, the largest decode bucket's)
# fills the held rows (the pending token and 3 proposals) exactly
RUNTIME = DEFAULT_RUNTIME.model_copy(
    update={"speculation": DEFAULT_RUNTIME.speculation.model_copy(update={"num_tokens": 3})}
)
BLOCK = RUNTIME.block_size


def recurrence(q, k, v, g, beta, state):
    """The gated delta rule token by token, the plain form of ref.chunk_gated_delta's docstring."""
    state, out = state.copy(), np.empty_like(v)
    for t in range(len(q)):
        state *= np.exp(g[t])[:, None, None]
        delta = beta[t][:, None] * (v[t] - np.einsum("hkv,hk->hv", state, k[t]))
        state += k[t][:, :, None] * delta[:, None, :]
        out[t] = np.einsum("hkv,hk->hv", state, q[t])
    return out, state


@pytest.mark.parametrize("steps", [1, 37, 64, 150])
def test_chunked_form_equals_the_token_by_token_recurrence(steps):
    """Lengths within one chunk, exactly one, and past two (the last one padded), from a random
    initial state: one head decays slowly, so that state reaches every chunk."""
    rng = np.random.default_rng(steps)
    heads, dk, dv = 3, 16, 8
    q, k = (a / np.linalg.norm(a, axis=-1, keepdims=True) for a in rng.normal(size=(2, steps, heads, dk)))
    v = rng.normal(size=(steps, heads, dv))
    g = -rng.uniform(0, 1, (steps, heads)) * [0.01, 1, 8]
    beta = rng.uniform(0, 1, (steps, heads))
    state = rng.normal(size=(heads, dk, dv))
    want_out, want_state = recurrence(q, k, v, g, beta, state)
    out, final = ref.chunk_gated_delta(q, k, v, g, beta, state)
    assert np.abs(out - want_out).max() < 1e-10 and np.abs(final - want_state).max() < 1e-10
    out, final = ref.chunk_gated_delta(q, k, v, g, beta)  # no state: zeros
    want_out, want_state = recurrence(q, k, v, g, beta, np.zeros_like(state))
    assert np.abs(out - want_out).max() < 1e-10 and np.abs(final - want_state).max() < 1e-10


@pytest.fixture(scope="module")
def served(tmp_path_factory) -> tuple[ModelRunner, ref.RefModel]:
    """The tiny Qwen3.5 GGUF's runner (RUNTIME) and its numpy reference."""
    directory = tmp_path_factory.mktemp("qwen35")
    hf.build("qwen35", directory, seed=0)
    path = hf.write_gguf(directory, directory / "qwen35.gguf", "qwen35")
    return ModelRunner.from_checkpoint(load_checkpoint(path), RUNTIME), ref.load_gguf_reference(path)


def prompt(length: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, 151_936, length).tolist()  # the qwen35 vocabulary's ids


def logits_of(call, runner: ModelRunner, *args, **kwargs) -> np.ndarray:
    """The logits [rows, vocab] of the one graph call that `call(runner, *args, **kwargs)` (a step of
    runner_calls) makes."""
    return logits_and_answer(call, runner, *args, **kwargs)[0]


def logits_and_answer(call, runner: ModelRunner, *args, **kwargs):
    """logits_of's logits, and what `call` returned."""
    seen = []
    graphs = runner.graphs

    def kept(call):
        def keep(*args, **kwargs):
            out = call(*args, **kwargs)
            seen.append((out[0] if isinstance(out, tuple) else out).asnumpy())
            return out

        return keep

    with pytest.MonkeyPatch.context() as patch:
        for name in ("prefill", "decode", "mixed"):
            patch.setattr(graphs, name, kept(getattr(graphs, name)))
        answer = call(runner, *args, **kwargs)
    assert len(seen) == 1
    return seen[0], answer


def assert_close(got: np.ndarray, want: np.ndarray) -> None:
    diff, scale = np.abs(got - want).max(), np.abs(want).max()
    assert diff < TOLERANCE * scale, (diff, scale)


def decode_rows(
    runner: ModelRunner, model: ref.RefModel, slots: list[int], caches: dict[int, ref.RefCache]
) -> None:
    """One decode step of `slots` together: each row's logits equal its own reference's next ones."""
    pending = [runner.active(slot).next_token for slot in slots]
    got = logits_of(calls.decode, runner, slots)
    for row, (slot, token) in enumerate(zip(slots, pending)):
        assert_close(got[row], ref.forward(model, [token], caches[slot])[-1])


def test_prefill_and_decode_logits_match_reference(served, release_all):
    """Every row of a 100-token prompt (the reference's chunks: 64 and 36), then 6 decode steps."""
    runner, model = served
    release_all(runner)
    tokens, cache = prompt(100, seed=0), ref.RefCache()
    got = logits_of(calls.prefill, runner, 0, tokens, GREEDY, score=SCORED)
    assert_close(got[:100], ref.forward(model, tokens, cache))
    for _ in range(6):
        decode_rows(runner, model, [0], {0: cache})


def test_a_prompt_in_chunks_equals_it_in_one_piece(served, release_all):
    """Chunks of 37, 60 and 3 tokens, each going on from the state (conv inputs and recurrent state)
    the one before left in its slot: every row equals the one-piece prefill's and the reference's."""
    runner, model = served
    release_all(runner)
    tokens = prompt(100, seed=1)
    want = ref.forward(model, tokens, ref.RefCache())
    whole = logits_of(calls.prefill, runner, 0, tokens, GREEDY, score=SCORED)[:100]
    pieces = []
    for start, end in [(0, 37), (37, 97)]:
        chunk = logits_of(calls.prefill_chunk, runner, 1, tokens[:end], None, start, SCORED)
        pieces.append(chunk[: end - start])
    pieces.append(logits_of(calls.prefill, runner, 1, tokens, GREEDY, start=97, score=SCORED)[:3])
    pieces = np.concatenate(pieces)
    assert_close(pieces, want)
    assert np.abs(pieces - whole).max() < 1e-5 * np.abs(want).max()


def test_sequences_decoding_together_each_keep_their_own_state(served, release_all):
    """Prompts of 100, 41 and 7 tokens in slots 0, 1, 2, decoded together (rows in the order 2, 0,
    1, a padding row after them) for 4 steps: each row equals its own sequence's reference."""
    runner, model = served
    release_all(runner)
    caches = {}
    for slot, length in [(0, 100), (1, 41), (2, 7)]:
        tokens = prompt(length, seed=10 + slot)
        caches[slot] = ref.RefCache()
        ref.forward(model, tokens, caches[slot])
        calls.prefill(runner, slot, tokens, GREEDY)
    for _ in range(4):
        decode_rows(runner, model, [2, 0, 1], caches)


def test_a_released_slot_starts_its_next_prompt_from_a_zero_state(served, release_all):
    """A slot's next prompt after release: every row equals a fresh reference's, where the state the
    first prompt left (a reference that keeps it) would put the first rows far off."""
    runner, model = served
    release_all(runner)
    first, second = prompt(60, seed=20), prompt(12, seed=21)
    calls.prefill(runner, 3, first, GREEDY)
    calls.decode(runner, [3])
    runner.release(3)
    got = logits_of(calls.prefill, runner, 3, second, GREEDY, score=SCORED)[:12]
    want = ref.forward(model, second, ref.RefCache())
    assert_close(got, want)
    left = ref.RefCache()
    ref.forward(model, first, left)
    stale = ref.forward(model, second, ref.RefCache(conv=left.conv, recurrent=left.recurrent))
    assert np.abs(stale - want).max() > 100 * TOLERANCE * np.abs(want).max()


def test_a_mixed_step_matches_reference(served, release_all):
    """One mixed call: decode rows of slots 0 and 1, the last 4 tokens of slot 2's prompt (its first
    20 prefilled before: a state to go on from) and slot 3's whole prompt (from a zero state); then
    a decode step of all four from the states the mixed call left."""
    runner, model = served
    release_all(runner)
    prompts = {slot: prompt(length, seed=30 + slot) for slot, length in enumerate([50, 9, 24, 6])}
    caches = {slot: ref.RefCache() for slot in prompts}
    for slot in (0, 1):
        ref.forward(model, prompts[slot], caches[slot])
        calls.prefill(runner, slot, prompts[slot], GREEDY)
    calls.prefill_chunk(runner, 2, prompts[2][:20], None)
    pending = [runner.active(slot).next_token for slot in (0, 1)]
    chunks = [calls.chunk(2, prompts[2], GREEDY, start=20), calls.chunk(3, prompts[3], GREEDY)]
    got = logits_of(calls.step, runner, [0, 1], [], chunks)
    want = [
        ref.forward(model, [pending[0]], caches[0])[-1],
        ref.forward(model, [pending[1]], caches[1])[-1],
        ref.forward(model, prompts[2], caches[2])[-1],
        ref.forward(model, prompts[3], caches[3])[-1],
    ]
    for row in range(4):
        assert_close(got[row], want[row])
    decode_rows(runner, model, [0, 1, 2, 3], caches)


# ------------------------------------------------------------------- speculative decoding's rollback


def delta_state(runner: ModelRunner, index: int) -> np.ndarray:
    """State slot `index`'s Gated DeltaNet state (every DeltaNet layer's conv inputs and recurrent
    matrices, one vector) as the kernel left it: a live slot, or a snapshot after the live ones."""
    layers = [layer for layer in runner.graphs.model.layers if hasattr(layer, "recurrent_state")]
    assert len(layers) == 3
    return np.concatenate(
        [np.concatenate([x.conv_state.asnumpy()[index], x.recurrent_state.asnumpy()[index]]) for x in layers]
    )


def greedy_after(model: ref.RefModel, cache: ref.RefCache, pending: int, n: int) -> list[int]:
    """The reference's greedy n tokens after `pending` (the cache left as it is), each one's lead over
    the runner's float32 error so that the runner's argmax is the same token."""
    cache, token, out = copy.deepcopy(cache), pending, []
    for _ in range(n):
        logits = ref.forward(model, [token], cache)[-1]
        second, first = np.sort(logits)[-2:]
        assert first - second > TOLERANCE * np.abs(logits).max(), "a near tie: take another prompt"
        token = int(np.argmax(logits))
        out.append(token)
    return out


def verify(
    runner: ModelRunner, model: ref.RefModel, slot: int, proposals: list[int], cache: ref.RefCache
) -> list[int]:
    """A verify step of `proposals` for `slot` alone: each of its rows (the pending token's, then each
    proposal's) equals the reference's over all of them, and the slot's tokens are the proposals the
    reference's argmax keeps and the one after; `cache` goes on over the rows kept. -> its tokens."""
    pending = runner.active(slot).next_token
    got, (decoded, _) = logits_and_answer(calls.step, runner, [slot], [], [], drafts={slot: proposals})
    want = ref.forward(model, [pending, *proposals], copy.deepcopy(cache))
    rows = len(proposals) + 1
    assert_close(got[:rows], want)
    kept = []
    for row in want:
        kept.append(int(np.argmax(row)))
        if len(kept) == rows or kept[-1] != proposals[len(kept) - 1]:
            break
    assert decoded == [kept], (decoded, kept, proposals)
    ref.forward(model, [pending, *kept[:-1]], cache)
    return kept


def wrong(token: int) -> int:
    return (token + 1) % 151_936


def prefilled_with_proposals(runner, model):
    """A 30-token prompt in slot 0 and in the reference: (its tokens, the reference's cache, the
    slot's pending token, the reference's next 3 greedy tokens after it: right proposals)."""
    tokens, cache = prompt(30, seed=40), ref.RefCache()
    ref.forward(model, tokens, cache)
    calls.prefill(runner, 0, tokens, GREEDY)
    pending = runner.active(0).next_token
    return tokens, cache, pending, greedy_after(model, cache, pending, 3)


def test_a_rejected_proposal_leaves_the_state_of_the_rows_kept(served, release_all):
    """Proposals [right, wrong, right]: the slot keeps its pending token and the first proposal, and
    the next decode steps (the first replays those 2 held rows onto the slot's state) equal the
    reference's over the tokens kept; the state of all 4 rows (the wrong one's) would be far off."""
    runner, model = served
    release_all(runner)
    tokens, cache, pending, right = prefilled_with_proposals(runner, model)
    proposals = [right[0], wrong(right[1]), right[2]]
    stale = copy.deepcopy(cache)
    assert verify(runner, model, 0, proposals, cache) == right[:2]
    got = logits_of(calls.decode, runner, [0])[0]
    assert_close(got, ref.forward(model, [right[1]], cache)[-1])
    # every row run, the wrong one's too, left in the state: the same KV, another recurrent state
    ref.forward(model, [pending, *proposals], stale)
    stale.keys, stale.values = [k[:-2] for k in stale.keys], [v[:-2] for v in stale.values]
    far = ref.forward(model, [right[1]], stale)[-1]
    assert np.abs(far - got).max() > 100 * TOLERANCE * np.abs(got).max()
    for _ in range(3):
        decode_rows(runner, model, [0], {0: cache})


def test_all_proposals_kept_then_a_second_verify_step(served, release_all):
    """3 right proposals (the most: the held rows full): all 4 rows kept and one token more; the next
    verify step (replaying those 4 rows first, then holding its own) with a wrong first proposal keeps
    only its pending token; then two verify steps of right proposals in a row and decode steps, every
    row equal to the reference's over the tokens kept."""
    runner, model = served
    release_all(runner)
    tokens, cache = prompt(25, seed=41), ref.RefCache()
    ref.forward(model, tokens, cache)
    calls.prefill(runner, 1, tokens, GREEDY)
    right = greedy_after(model, cache, runner.active(1).next_token, 4)
    assert verify(runner, model, 1, right[:3], cache) == right
    right = greedy_after(model, cache, runner.active(1).next_token, 1)
    assert verify(runner, model, 1, [wrong(right[0]), 5, 6], cache) == right
    for n in (2, 1):
        right = greedy_after(model, cache, runner.active(1).next_token, n + 1)
        assert verify(runner, model, 1, right[:n], cache) == right
    for _ in range(3):
        decode_rows(runner, model, [1], {1: cache})


def test_a_held_run_waits_for_its_own_slots_next_step(served, release_all):
    """Slot 0 verifies [right, wrong] beside slot 1's plain decode row (one mixed call); then slot 1
    decodes alone and slot 2 computes a prompt: slot 0's state stays as it was before its verify step
    (its rows ran on a copy: the replay belongs to its own next call). Its next step is a mixed one
    (the replay as a plain decode row of the mixed graph, beside slot 1's row and slot 3's prompt),
    then a decode step of both: every row equals the reference's."""
    runner, model = served
    release_all(runner)
    caches = {slot: ref.RefCache() for slot in (0, 1, 3)}
    for slot in (0, 1):
        tokens = prompt(20 + slot, seed=42 + slot)
        ref.forward(model, tokens, caches[slot])
        calls.prefill(runner, slot, tokens, GREEDY)
    before = delta_state(runner, 0)
    pending = [runner.active(slot).next_token for slot in (0, 1)]
    right = greedy_after(model, caches[0], pending[0], 2)
    proposals = [right[0], wrong(right[1])]
    got, (decoded, _) = logits_and_answer(calls.step, runner, [1, 0], [], [], drafts={0: proposals})
    assert_close(got[0], ref.forward(model, [pending[1]], caches[1])[-1])
    assert_close(got[1:4], ref.forward(model, [pending[0], *proposals], copy.deepcopy(caches[0])))
    assert decoded[1] == right
    ref.forward(model, [pending[0], right[0]], caches[0])
    assert np.array_equal(delta_state(runner, 0), before)
    decode_rows(runner, model, [1], caches)
    calls.prefill(runner, 2, prompt(9, seed=44), GREEDY)
    assert np.array_equal(delta_state(runner, 0), before)
    pending = [runner.active(slot).next_token for slot in (0, 1)]
    tokens = prompt(7, seed=45)
    got = logits_of(calls.step, runner, [0, 1], [], [calls.chunk(3, tokens, GREEDY)])
    assert_close(got[0], ref.forward(model, [pending[0]], caches[0])[-1])
    assert_close(got[1], ref.forward(model, [pending[1]], caches[1])[-1])
    assert_close(got[2], ref.forward(model, tokens, caches[3])[-1])
    assert not np.array_equal(delta_state(runner, 0), before)
    decode_rows(runner, model, [0, 1, 3], caches)


def test_two_slots_verified_in_one_step_replay_in_one_call(served, release_all):
    """Slots 0 and 1 verify one proposal each in one step, slot 0's right (2 rows kept), slot 1's
    wrong (1 row kept); the next decode step of both (rows in the order 1, 0) replays both held runs
    in one call: each row equals its own reference's."""
    runner, model = served
    release_all(runner)
    caches = {slot: ref.RefCache() for slot in (0, 1)}
    for slot in (0, 1):
        tokens = prompt(15 + slot, seed=47 + slot)
        ref.forward(model, tokens, caches[slot])
        calls.prefill(runner, slot, tokens, GREEDY)
    pending = [runner.active(slot).next_token for slot in (0, 1)]
    right = [greedy_after(model, caches[slot], pending[slot], 2) for slot in (0, 1)]
    drafts = {0: right[0][:1], 1: [wrong(right[1][0])]}
    got, (decoded, _) = logits_and_answer(calls.step, runner, [0, 1], [], [], drafts=drafts)
    for slot in (0, 1):
        rows = got[2 * slot : 2 * slot + 2]
        assert_close(rows, ref.forward(model, [pending[slot], *drafts[slot]], copy.deepcopy(caches[slot])))
    assert decoded == [right[0], right[1][:1]]
    ref.forward(model, [pending[0], right[0][0]], caches[0])
    ref.forward(model, [pending[1]], caches[1])
    for _ in range(2):
        decode_rows(runner, model, [1, 0], caches)


def test_a_recompute_after_a_verify_step_replays_nothing(served, release_all):
    """A preempted sequence keeps its slot and is recomputed (scheduler/batch_scheduler.py _preempt):
    here right after a verify step, a chunk from position 0 of every position written. Its rows
    equal the reference's, and its state then holds the kept rows already: the next decode step
    replays nothing and equals the reference's."""
    runner, model = served
    release_all(runner)
    tokens, cache, pending, right = prefilled_with_proposals(runner, model)
    kept = verify(runner, model, 0, [right[0], wrong(right[1]), right[2]], cache)
    written = [*tokens, pending, *kept[:-1]]
    got = logits_of(calls.prefill_chunk, runner, 0, written, None, 0, SCORED)
    assert_close(got[: len(written)], ref.forward(model, written, ref.RefCache()))
    got = logits_of(calls.decode, runner, [0])[0]
    assert_close(got, ref.forward(model, [kept[-1]], cache)[-1])


def test_more_proposals_than_the_held_rows_are_refused(served, release_all):
    """4 proposals: a held run keeps at most 4 rows (the pending token and speculation.num_tokens 3);
    refused before anything runs (the slot decodes on from its state as before)."""
    runner, model = served
    release_all(runner)
    tokens, cache = prompt(12, seed=46), ref.RefCache()
    ref.forward(model, tokens, cache)
    calls.prefill(runner, 0, tokens, GREEDY)
    with pytest.raises(RunnerError, match=r"proposals are 1\.\.3 tokens, got 4"):
        calls.step(runner, [0], [], [], drafts={0: [1, 2, 3, 4]})
    decode_rows(runner, model, [0], {0: cache})


# ------------------------------------------------------------------- state snapshots (prefix caching)


def test_a_prefix_hit_resumes_from_the_saved_state(served, release_all):
    """Slot 0 computes a prompt's first 2 blocks and saves its state into snapshot 0 (the slot's own
    state copied as it is); slot 1's prompt shares those 2 blocks (its table starts with slot 0's) and
    starts after them, restoring snapshot 0: every row of its chunk equals the reference's (and a
    cold run's in slot 2), where a zero state would be far off; then its decode steps."""
    runner, model = served
    release_all(runner)
    shared = 2 * BLOCK
    first_prompt = prompt(shared, seed=50)
    tokens = first_prompt + prompt(20, seed=51)
    first = runner.graphs.inputs.slot_table(0)
    calls.prefill_chunk(runner, 0, first_prompt, first, save=0)
    live = runner.graphs.inputs.num_slots + 1
    assert np.array_equal(delta_state(runner, live + 0), delta_state(runner, 0))
    second = runner.graphs.inputs.slot_table(1)
    second[:2] = first[:2]
    got = logits_of(calls.prefill, runner, 1, tokens, GREEDY, second, start=shared, score=SCORED, restore=0)
    cache = ref.RefCache()
    want = ref.forward(model, tokens, cache)[shared:]
    assert_close(got[:20], want)
    cold = logits_of(calls.prefill, runner, 2, tokens, GREEDY, score=SCORED)[shared : len(tokens)]
    assert np.abs(got[:20] - cold).max() < 1e-5 * np.abs(want).max()
    zero = ref.RefCache()
    ref.forward(model, first_prompt, zero)
    zero.conv, zero.recurrent = {}, {}
    far = ref.forward(model, tokens[shared:], zero)
    assert np.abs(far[0] - want[0]).max() > 100 * TOLERANCE * np.abs(want).max()
    for _ in range(3):
        pending = runner.active(1).next_token
        got = logits_of(calls.decode, runner, [1], [second])[0]
        assert_close(got, ref.forward(model, [pending], cache)[-1])


def test_a_snapshot_outlives_its_slot(served, release_all):
    """Snapshot 3 saved by slot 0 (3 blocks), slot 0 released and its state overwritten by another
    prompt (in other blocks); a mixed step restores snapshot 3 for slot 1's prompt (its 4th block)
    beside slot 0's decode row and saves slot 1's state after it into snapshot 4; slot 1 released,
    slot 2 restores snapshot 4 for the prompt's last 5 tokens. Both rows of the mixed step and every
    row of slot 2's chunk equal the reference's."""
    runner, model = served
    release_all(runner)
    shared = 3 * BLOCK
    tokens = prompt(4 * BLOCK + 5, seed=52)
    first = runner.graphs.inputs.slot_table(0)
    calls.prefill_chunk(runner, 0, tokens[:shared], first, save=3)
    runner.release(0)
    other, other_cache = prompt(10, seed=53), ref.RefCache()
    ref.forward(model, other, other_cache)
    calls.prefill(runner, 0, other, GREEDY, runner.graphs.inputs.slot_table(3))
    second = runner.graphs.inputs.slot_table(1)
    second[:3] = first[:3]
    pending = runner.active(0).next_token
    chunk = calls.chunk(1, tokens[: 4 * BLOCK], GREEDY, second, start=shared, restore=3, save=4)
    got = logits_of(calls.step, runner, [0], [], [chunk])
    want = ref.forward(model, tokens, ref.RefCache())
    assert_close(got[0], ref.forward(model, [pending], other_cache)[-1])
    assert_close(got[1], want[4 * BLOCK - 1])
    runner.release(1)
    third = runner.graphs.inputs.slot_table(2)
    third[:4] = second[:4]
    got = logits_of(calls.prefill, runner, 2, tokens, GREEDY, third, start=4 * BLOCK, score=SCORED, restore=4)
    assert_close(got[:5], want[4 * BLOCK :])


def test_state_moves_the_runner_cannot_do_are_refused(served, release_all):
    """A chunk after position 0 on a fresh slot without a snapshot (its state would be zeros), a
    restore into a chunk from position 0, and snapshots outside 0..state_snapshots-1: each a
    RunnerError from runner.execute, in a prefill step and a mixed one, before anything runs (the slot
    stays free)."""
    runner, model = served
    release_all(runner)
    tokens, table = prompt(2 * BLOCK + 3, seed=54), runner.graphs.inputs.slot_table(1)
    last = RUNTIME.state_snapshots - 1
    refused = [
        (dict(start=BLOCK), f"state holds 0 positions: a chunk from position {BLOCK} restores a snapshot's"),
        (dict(restore=0), "a chunk from position 0 restores no state"),
        (dict(start=BLOCK, restore=last + 1), rf"restore snapshot {last + 1} is outside 0\.\.{last}"),
        (dict(start=BLOCK, restore=-1), rf"restore snapshot -1 is outside 0\.\.{last}"),
        (dict(save=last + 1), rf"save snapshot {last + 1} is outside 0\.\.{last}"),
    ]
    calls.prefill(runner, 0, prompt(5, seed=55), GREEDY)
    for fields, message in refused:
        with pytest.raises(RunnerError, match=message):
            calls.prefill_chunk(runner, 1, tokens, table, **fields)
        with pytest.raises(RunnerError, match=message):
            calls.step(runner, [0], [], [calls.chunk(1, tokens, GREEDY, table, **fields)])
        assert 1 not in runner.slots
    cache = ref.RefCache()
    got = logits_of(calls.prefill, runner, 1, tokens, GREEDY, table, score=SCORED)
    assert_close(got[: len(tokens)], ref.forward(model, tokens, cache))
