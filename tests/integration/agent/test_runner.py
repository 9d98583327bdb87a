"""ModelRunner behaviour: batching, slot reuse, sampling through the graphs, and request errors."""

import numpy as np
import pytest

import runner_calls as calls
from agent.contract.sampling import NO_TOKEN, SamplingParams
from agent.contract.step import StepChunk, StepRequest
from agent.model.tokenizer import load_tokenizer
from agent.runner import RunnerError
from agent.warm_up import graph_shapes, warm_up

GREEDY = SamplingParams()


def generate_alone(runner, prompt, n, slot=0, params=GREEDY):
    tokens = [calls.prefill(runner, slot, prompt, params)]
    while len(tokens) < n:
        tokens += calls.decode(runner, [slot])
    runner.release(slot)
    return tokens


def generate_together(runner, prompts, n, params=GREEDY):
    slots = list(range(len(prompts)))
    out = [[calls.prefill(runner, s, p, params)] for s, p in zip(slots, prompts)]
    for _ in range(n - 1):
        for seq, token in zip(out, calls.decode(runner, slots)):
            seq.append(token)
    for s in slots:
        runner.release(s)
    return out


def chat_prompts(path, questions):
    tokenizer = load_tokenizer(path)
    return [tokenizer.encode_chat([{"role": "user", "content": q}]) for q in questions]


def test_batch_invariance_tiny(tiny_llama_runner, tiny_llama_dir, release_all):
    release_all(tiny_llama_runner)
    tok = load_tokenizer(tiny_llama_dir)
    prompts = [tok.encode(t) for t in ["The quick brown fox", "你好，世界！ 东京", "emoji 😀 🎉 and"]]
    alone = [generate_alone(tiny_llama_runner, p, 12) for p in prompts]
    assert generate_together(tiny_llama_runner, prompts, 12) == alone


@pytest.mark.default_model
def test_batch_invariance_default_model(default_runner, default_model_path, release_all):
    release_all(default_runner)
    prompts = chat_prompts(
        default_model_path,
        ["What is the capital of France?", "Say hello in three languages, please.", "Why is the sky blue?"],
    )
    assert len({len(p) for p in prompts}) == 3  # different lengths, different positions
    alone = [generate_alone(default_runner, p, 16) for p in prompts]
    assert generate_together(default_runner, prompts, 16) == alone


def test_released_slot_is_reused_without_leaking(tiny_llama_runner, tiny_llama_dir, release_all):
    release_all(tiny_llama_runner)
    tok = load_tokenizer(tiny_llama_dir)
    long_prompt = tok.encode("The quick brown fox jumps over the lazy dog. " * 2)
    short_prompt = tok.encode("Numbers 0123")
    fresh = generate_alone(tiny_llama_runner, short_prompt, 10, slot=3)
    generate_alone(tiny_llama_runner, long_prompt, 20, slot=2)  # fills slot 2 far beyond short_prompt
    assert generate_alone(tiny_llama_runner, short_prompt, 10, slot=2) == fresh


def test_greedy_rows_stay_greedy_beside_sampled_rows(tiny_llama_runner, tiny_llama_dir, release_all):
    release_all(tiny_llama_runner)
    tok = load_tokenizer(tiny_llama_dir)
    prompt = tok.encode("The capital of France")
    greedy = generate_alone(tiny_llama_runner, prompt, 10)
    hot = SamplingParams(do_sample=True, temperature=1.5, top_k=0, seed=3)
    first = [
        calls.prefill(tiny_llama_runner, 0, prompt, GREEDY),
        calls.prefill(tiny_llama_runner, 1, prompt, hot),
    ]
    seqs = [[first[0]], [first[1]]]
    for _ in range(9):
        for seq, token in zip(seqs, calls.decode(tiny_llama_runner, [0, 1])):
            seq.append(token)
    assert seqs[0] == greedy
    assert seqs[1] != greedy  # a hot sampler over a ~400-token vocabulary does not copy greedy


def test_seeded_sampling_reproduces_and_top_k_1_is_greedy(tiny_llama_runner, tiny_llama_dir, release_all):
    release_all(tiny_llama_runner)
    prompt = load_tokenizer(tiny_llama_dir).encode("The quick brown fox")
    params = SamplingParams(do_sample=True, temperature=1.2, top_k=50, top_p=0.95, seed=1234)
    first = generate_alone(tiny_llama_runner, prompt, 16, params=params)
    assert generate_alone(tiny_llama_runner, prompt, 16, slot=1, params=params) == first
    other = generate_alone(tiny_llama_runner, prompt, 16, params=params.model_copy(update={"seed": 99}))
    assert other != first
    top1 = SamplingParams(do_sample=True, temperature=0.7, top_k=1, seed=5)
    assert generate_alone(tiny_llama_runner, prompt, 12, params=top1) == generate_alone(
        tiny_llama_runner, prompt, 12
    )


def test_repetition_penalty_matches_full_vocabulary_computation(
    tiny_llama_runner, tiny_llama_dir, release_all
):
    """Greedy with a penalty through the top-k graph equals the penalty applied to all logits."""
    release_all(tiny_llama_runner)
    runner = tiny_llama_runner
    prompt = load_tokenizer(tiny_llama_dir).encode("The quick brown fox jumps")
    penalty = 1.8
    got = generate_alone(runner, prompt, 8, params=SamplingParams(repetition_penalty=penalty))
    seen, want, tokens = set(prompt), [], list(prompt)
    table = runner.graphs.inputs.slot_table(0)
    logits = runner.graphs.prefill(table, np.asarray(tokens), 16).asnumpy()[0]
    for step in range(8):
        ids = np.array(sorted(seen))
        logits[ids] = np.where(logits[ids] > 0, logits[ids] / penalty, logits[ids] * penalty)
        token = int(np.argmax(logits))
        want.append(token)
        seen.add(token)
        logits = runner.graphs.decode(
            table[None, :], np.array([token]), np.array([len(prompt) + step]), 1, 32
        )[0].asnumpy()[0]
    assert got == want


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda r: calls.prefill(r, 9, [1, 2], GREEDY), "slot 9 is out of range"),
        (lambda r: calls.prefill(r, 0, [], GREEDY), "non-empty"),
        (lambda r: calls.prefill(r, 0, [1, 10_000], GREEDY), "token ids must lie in"),
        (
            lambda r: calls.prefill(r, 0, [1] * 64, GREEDY),
            "prompt of 64 tokens exceeds the longest prompt this agent accepts \\(63 tokens\\)",
        ),
        (lambda r: calls.decode(r, [2]), "slot 2 holds no sequence"),
        (lambda r: calls.decode(r, []), "at least one slot"),
        (lambda r: r.release(-1), "out of range"),
    ],
)
def test_bad_requests_raise_clear_errors(tiny_llama_runner, call, message, release_all):
    release_all(tiny_llama_runner)
    with pytest.raises(RunnerError, match=message):
        call(tiny_llama_runner)


def test_busy_slot_repeated_slot_and_full_slot(tiny_llama_runner, release_all):
    release_all(tiny_llama_runner)
    runner = tiny_llama_runner
    calls.prefill(runner, 0, [5] * 63, GREEDY)
    with pytest.raises(RunnerError, match="slot 0 has sampled already"):
        calls.prefill(runner, 0, [5], GREEDY)
    with pytest.raises(RunnerError, match="repeat"):
        calls.decode(runner, [0, 0])
    calls.decode(runner, [0])  # writes position 63, the last one
    with pytest.raises(RunnerError, match="slot 0 is full"):
        calls.decode(runner, [0])
    assert runner.slot_table.slot_length(0) == 64 and runner.slot_table.free_slots == [1, 2, 3]


def test_warm_up_compiles_every_bucket(tiny_llama_runner):
    lines = []
    elapsed = warm_up(tiny_llama_runner, lines.append)
    shapes = graph_shapes(tiny_llama_runner)
    # 2 prefill buckets + 3 batch buckets (the attention kernel needs no attend buckets) + a mixed
    # step per batch bucket (fused layers) + argmax + top-k buckets
    assert tiny_llama_runner.mixed_rows > 0
    assert len(shapes) == 2 + 3 + 3 + 1 + len(tiny_llama_runner.topk_buckets)
    assert len(lines) == len(shapes) + 1 and lines[-1].startswith("warm-up done")
    assert elapsed > 0 and np.all([f"{i}/{len(shapes)}" in lines[i - 1] for i in range(1, len(shapes) + 1)])


def test_whole_vocabulary_rows_skip_the_whole_vocabulary_top_k(
    tiny_llama_runner, tiny_llama_dir, release_all
):
    """A sampled row without top_k no longer makes the batch run a top-k over the whole vocabulary
    (its cost grows with the vocabulary and is paid by every row); it samples on the host, by seed.
    The graph set is wrapped to record which top-k graphs run: nothing else observes that."""
    release_all(tiny_llama_runner)
    prompt = load_tokenizer(tiny_llama_dir).encode("The quick brown fox")
    hot = SamplingParams(do_sample=True, temperature=1.3, top_p=0.9, seed=11)
    first = generate_alone(tiny_llama_runner, prompt, 12, params=hot)
    graphs, ks = tiny_llama_runner.graphs, []
    original_topk = graphs.topk

    def recording_topk(k, logits):
        ks.append(k)
        return original_topk(k, logits)

    graphs.topk = recording_topk
    try:
        alone = generate_alone(tiny_llama_runner, prompt, 12, params=hot)
        topk_row = SamplingParams(do_sample=True, top_k=5, seed=1)
        batch = [
            calls.prefill(tiny_llama_runner, 0, prompt, hot),
            calls.prefill(tiny_llama_runner, 1, prompt, topk_row),
        ]
        seqs = [[batch[0]], [batch[1]]]
        for _ in range(11):
            for seq, token in zip(seqs, calls.decode(tiny_llama_runner, [0, 1])):
                seq.append(token)
        release_all(tiny_llama_runner)
    finally:
        del graphs.topk
    assert alone == first == seqs[0]  # same tokens alone, again, and beside a top-k row
    assert ks and tiny_llama_runner.spec.vocab_size not in ks, ks  # only the top-k row's small graph


@pytest.mark.parametrize(
    "params",
    [
        # top-k candidates from the device
        SamplingParams(do_sample=True, temperature=1.4, top_k=40, min_p=0.05, typical_p=0.9, seed=5),
        # the whole row on the host: min_p's nucleus, typical_p's full order
        SamplingParams(do_sample=True, temperature=1.4, min_p=0.02, seed=6),
        SamplingParams(do_sample=True, temperature=1.3, typical_p=0.8, top_p=0.95, seed=7),
    ],
)
def test_min_p_and_typical_p_rows_draw_alike_alone_and_in_any_batch(
    tiny_llama_runner, tiny_llama_dir, release_all, params
):
    """Batch invariance through the graphs: a seeded row with min_p / typical_p draws the same tokens
    alone and beside rows of other parameters (greedy, a larger top-k that brings more candidates,
    logprobs that bring every row's logits to the host, another min_p), whatever its slot."""
    release_all(tiny_llama_runner)
    runner, tok = tiny_llama_runner, load_tokenizer(tiny_llama_dir)
    prompt = tok.encode("The capital of France")
    alone = generate_alone(runner, prompt, 12, params=params)
    assert len(set(alone)) > 1
    greedy, wide, logprobs, other = (
        GREEDY,
        SamplingParams(do_sample=True, top_k=200, repetition_penalty=1.3, seed=1),
        SamplingParams(do_sample=True, temperature=0.8, logprobs=3, seed=2),
        SamplingParams(do_sample=True, min_p=0.3, typical_p=0.5, seed=3),
    )
    texts = ["The quick brown fox", "emoji 😀 and", "Numbers 0123"]
    # (slot, prompt, parameters), the row under test first
    batches = [
        [(2, prompt, params), *zip([0, 1, 3], [tok.encode(t) for t in texts], [greedy, wide, other])],
        [(0, prompt, params), (1, tok.encode(texts[0]), logprobs)],
    ]
    for batch in batches:
        seqs = [[calls.prefill(runner, slot, ids, p)] for slot, ids, p in batch]
        slots = [slot for slot, _, _ in batch]
        for _ in range(11):
            for seq, token in zip(seqs, calls.decode(runner, slots)):
                seq.append(token)
        for slot in slots:
            runner.release(slot)
        assert seqs[0] == alone


def bitmask(vocab: int, allowed) -> np.ndarray:
    """A token mask as the server sends it: bit j of int32 word i allows token 32 i + j."""
    bits = np.zeros(((vocab + 31) // 32) * 32, np.uint8)
    bits[list(allowed)] = 1
    return np.packbits(bits, bitorder="little").view("<i4").astype(np.int32)


def test_token_masks_choose_within_them_and_leave_other_rows_alone(
    tiny_llama_runner, tiny_llama_dir, release_all
):
    """Structured output's masks: a masked row (greedy, sampled or asking for logprobs) picks only
    allowed tokens; the unmasked row beside it keeps its answer alone."""
    release_all(tiny_llama_runner)
    runner, vocab = tiny_llama_runner, tiny_llama_runner.spec.vocab_size
    prompt = load_tokenizer(tiny_llama_dir).encode("The capital of France")
    alone = generate_alone(runner, prompt, 6)
    allowed = [5, 17, 99]
    hot = SamplingParams(do_sample=True, temperature=1.5, seed=3, logprobs=2)
    assert calls.prefill(runner, 0, prompt, GREEDY, mask=bitmask(vocab, [alone[0] + 1])) == alone[0] + 1
    seqs = [
        [calls.prefill(runner, 1, prompt, GREEDY)],
        [calls.prefill(runner, 2, prompt, hot, mask=bitmask(vocab, allowed))],
    ]
    for _ in range(5):
        masks = {0: bitmask(vocab, allowed), 2: bitmask(vocab, allowed)}
        decoded = runner.execute(StepRequest(slots=[0, 1, 2], masks=masks)).decoded
        got = [sampled.token for (sampled,) in decoded]
        assert got[0] in allowed and decoded[2][0].logprob.top[0][0] in allowed
        for seq, token in zip(seqs, got[1:]):
            seq.append(token)
    assert seqs[0] == alone and all(t in allowed for t in seqs[1])
    short = bitmask(vocab, [3])[:1]  # one word: the tokens past it are not allowed
    assert calls.decode(runner, [1], masks={1: short}) == [3]


def test_execute_replies_with_logprobs_prompt_scores_and_each_sequences_fault(
    tiny_llama_runner, tiny_llama_dir, release_all
):
    """What the agent service sends back is all in execute's StepReply: a chunk's first token with
    its logprobs and the prompt logprobs it asked for, a decode slot's token with its logprobs, and
    a sequence whose choice failed (its mask allows only EOS, which min_tokens keeps out) with its
    own fault and no token, beside the others."""
    release_all(tiny_llama_runner)
    runner, vocab = tiny_llama_runner, tiny_llama_runner.spec.vocab_size
    prompt = load_tokenizer(tiny_llama_dir).encode("The capital of France")
    asks = SamplingParams(logprobs=2)
    reply = runner.execute(StepRequest(chunks=[StepChunk(0, prompt, None, 0, asks, prompt_logprobs=2)]))
    (first,) = reply.firsts
    assert (
        first is not None
        and first.fault is None
        and first.token == generate_alone(runner, prompt, 1, slot=2)[0]
    )
    assert (
        first.logprob is not None and len(first.logprob.top) == 2 and first.logprob.top[0][0] == first.token
    )
    (scores,) = reply.prompts
    assert scores is not None and len(scores) == len(prompt) - 1 and all(len(e.top) == 2 for e in scores)

    eos = runner.spec.eos_ids[0]
    stuck = StepChunk(1, prompt, None, 0, SamplingParams(min_tokens=3))
    (failed,) = runner.execute(StepRequest(chunks=[stuck], masks={1: bitmask(vocab, [eos])})).firsts
    assert failed is not None and failed.token == NO_TOKEN and failed.logprob is None
    assert (
        failed.fault is not None and failed.fault.kind == "request" and "min_tokens" in failed.fault.message
    )

    ((token,),) = runner.execute(StepRequest(slots=[0])).decoded
    assert token.fault is None and token.logprob is not None and token.logprob.top[0][0] == token.token
    with pytest.raises(RunnerError, match="ended with an error"):
        runner.execute(StepRequest(slots=[1]))  # a faulted sequence decodes no more


@pytest.mark.parametrize(
    "masks, message",
    [
        ({0: np.zeros(1, np.int32)}, "allows no token"),
        ({0: np.full(99, -1, np.int32)}, "int32 words"),
        ({0: np.full(2, -1, np.int64)}, "int32 words"),
        ({1: np.full(2, -1, np.int32)}, "samples nothing"),
    ],
)
def test_bad_token_masks_are_refused_before_anything_runs(
    tiny_llama_runner, tiny_llama_dir, masks, message, release_all
):
    release_all(tiny_llama_runner)
    prompt = load_tokenizer(tiny_llama_dir).encode("The capital")
    calls.prefill(tiny_llama_runner, 0, prompt, GREEDY)
    with pytest.raises(RunnerError, match=message):
        calls.decode(tiny_llama_runner, [0], masks=masks)
    assert tiny_llama_runner.slot_table.slot_length(0) == len(prompt)  # nothing ran
