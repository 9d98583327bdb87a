"""The MindSpore graphs against the independent numpy reference (tests/support/reference_numpy.py)."""

import json

import numpy as np
import pytest
from conftest import DEFAULT_RUNTIME, TINY_RUNTIME

import reference_numpy as ref
import runner_calls as calls
from agent.contract.sampling import SamplingParams
from agent.known_answer import KnownAnswer
from agent.model.formats import load_checkpoint
from agent.model.tokenizer import load_tokenizer
from agent.runner import ModelRunner
from agent.warm_up import warm_up
from config.schema import PROJECT_ROOT
from int8_comparison import Int8Reach
from scheduler.speculation.ngram import NgramIndex
from tiny_models import write_tiny_checkpoint

GREEDY = SamplingParams()
CHAT_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three prime numbers and explain why they are prime.",
]


def compare_logits(
    runner: ModelRunner, reference: ref.RefModel, prompt: list[int], slot: int, steps: int = 4
) -> list[float]:
    """Max |logit difference| at prefill and after each of `steps` decode steps."""
    bucket = next(b for b in runner.runtime.prefill_buckets if b >= len(prompt))
    cache = ref.RefCache()
    table = runner.graphs.inputs.slot_table(slot)
    got = runner.graphs.prefill(table, np.asarray(prompt), bucket).asnumpy()[0]
    want = ref.forward(reference, prompt, cache)[-1]
    diffs = [float(np.abs(got - want).max())]
    token, position = int(np.argmax(want)), len(prompt)
    for _ in range(steps):
        attend = next(a for a in runner.runtime.attend_buckets if a > position)  # gather path only
        got = runner.graphs.decode(table[None, :], np.array([token]), np.array([position]), 1, attend)[
            0
        ].asnumpy()[0]
        want = ref.forward(reference, [token], cache)[-1]
        diffs.append(float(np.abs(got - want).max()))
        token, position = int(np.argmax(want)), position + 1
    return diffs


@pytest.mark.parametrize(
    "attention, matmul", [("kernel", "kernel"), ("gather", "kernel"), ("kernel", "mindspore")]
)
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_tiny_checkpoint_logits_match_reference(
    family, attention, matmul, tiny_llama_dir, tiny_qwen2_dir, kernel_target
):
    """Both decode attention paths (the custom CPU kernel; gather + batched matmuls) and both
    matmul paths (the custom kernel on packed weights; MindSpore's MatMul), at every kernel target."""
    directory = tiny_llama_dir if family == "llama" else tiny_qwen2_dir
    runtime = TINY_RUNTIME.model_copy(update={"decode_attention": attention, "matmul": matmul})
    runner = ModelRunner.from_checkpoint(load_checkpoint(directory), runtime)
    # with both kernels each decode layer is one fused op (agent/kernels/fused_layer.cc)
    fused = runner.graphs.model.layers[0].kernel_layer is not None
    assert fused == (attention == matmul == "kernel")
    reference = ref.load_hf_reference(directory)
    prompt = load_tokenizer(directory).encode("The capital of France is Paris. 你好")
    diffs = compare_logits(runner, reference, prompt, slot=1, steps=6)
    assert max(diffs) < 1e-3, diffs


def test_widths_off_the_kernel_tile_match_reference(tmp_path):
    """Hidden 48 and FFN 80: output widths that are not a multiple of the matmul kernel's tile."""
    directory = write_tiny_checkpoint(tmp_path, "llama", seed=3, hidden=48, intermediate=80)
    runner = ModelRunner.from_checkpoint(load_checkpoint(directory), TINY_RUNTIME)
    assert runner.graphs.model.layers[0].kernel_layer is None  # op by op: hidden is not whole tiles
    prompt = load_tokenizer(directory).encode("odd widths")
    diffs = compare_logits(runner, ref.load_hf_reference(directory), prompt, slot=0, steps=3)
    assert max(diffs) < 1e-3, diffs


@pytest.mark.default_model
def test_default_model_logits_match_reference(default_runner, default_model_path):
    reference = ref.load_gguf_reference(default_model_path)
    tokenizer = load_tokenizer(default_model_path)
    prompt = tokenizer.encode_chat([{"role": "user", "content": CHAT_PROMPTS[0]}])
    assert len(prompt) == 37
    q4_1 = [3] * 7  # every layer matrix multiplied from its Q4_1 blocks (GGML type 3)
    assert all(layer.formats.asnumpy().tolist() == q4_1 for layer in default_runner.graphs.model.layers)
    diffs = compare_logits(default_runner, reference, prompt, slot=0, steps=4)
    assert max(diffs) < 1e-3, diffs


@pytest.fixture
def default_runner_at_target(kernel_target, request, default_model_path) -> ModelRunner:
    """The default model's runner with the kernels of this test's target (native: the shared one)."""
    if kernel_target == "native":
        return request.getfixturevalue("default_runner")
    return ModelRunner.from_checkpoint(load_checkpoint(default_model_path), DEFAULT_RUNTIME)


@pytest.mark.default_model
def test_default_model_greedy_matches_reference_and_says_paris(
    default_runner_at_target, default_model_path, release_all
):
    """At every kernel target this machine runs: the AVX-512, AVX2 and portable code paths."""
    default_runner = default_runner_at_target
    release_all(default_runner)
    reference = ref.load_gguf_reference(default_model_path)
    tokenizer = load_tokenizer(default_model_path)
    for i, question in enumerate(CHAT_PROMPTS):
        prompt = tokenizer.encode_chat([{"role": "user", "content": question}])
        want = ref.greedy(reference, prompt, 32)
        got = [calls.prefill(default_runner, i, prompt, GREEDY)]
        while len(got) < 32:
            got += calls.decode(default_runner, [i])
        assert got == want, (question, tokenizer.decode(got), tokenizer.decode(want))
        if i == 0:
            assert "Paris" in tokenizer.decode(got)


@pytest.mark.default_model
def test_default_model_with_int8_activations_warms_up_and_answers_within_the_q8_1_references_reach(
    default_model_path, int8_kernel_target
):
    """runtime.activations int8 on the default model, at every kernel target with int8 products
    (AVX-512 VNNI and AVX2 on an AVX-512 machine): the warm-up's known-answer check passes with every
    call (a decode batch of 1 and of 40, mixed steps of 40 sequences) held to the int8 tolerance, and
    each held-out prompt's greedy answer (its prompt and 7 decode steps) takes the int8 products and
    stays within the Q8_1 reference's reach (int8_comparison.Int8Reach: on the France question the
    reference's first token itself turns on float32 ulps, so no exact token is owed there; alone, in
    batches and in mixed steps the answers are equal, test_int8_batch_invariance)."""
    runtime = DEFAULT_RUNTIME.model_copy(
        update={"num_slots": 40, "decode_batch_buckets": [1, 40], "activations": "int8"}
    )
    checkpoint = load_checkpoint(default_model_path)
    runner = ModelRunner.from_checkpoint(checkpoint, runtime)
    warm_up(runner, lambda line: None, known=KnownAnswer.of_checkpoint(checkpoint, runtime))
    reference = ref.load_gguf_reference(default_model_path)
    tokenizer = load_tokenizer(default_model_path)
    for slot, question in enumerate(CHAT_PROMPTS):
        prompt = tokenizer.encode_chat([{"role": "user", "content": question}])
        reach, table = Int8Reach(reference), runner.graphs.inputs.slot_table(slot)
        bucket = next(b for b in runner.runtime.prefill_buckets if b >= len(prompt))
        got = runner.graphs.prefill(table, np.asarray(prompt), bucket).asnumpy()[0]
        answer = [reach.check(got, prompt)]
        while len(answer) < 8:
            position = len(prompt) + len(answer) - 1
            attend = next(a for a in runner.runtime.attend_buckets if a > position)
            got = runner.graphs.decode(table[None, :], np.array(answer[-1:]), np.array([position]), 1, attend)
            answer.append(reach.check(got[0].asnumpy()[0], answer[-1:]))
        assert answer == runner_answer(runner, slot, prompt, len(answer)), question


def runner_answer(runner: ModelRunner, slot: int, prompt: list[int], length: int) -> list[int]:
    """The runner's own greedy answer: the sampling graphs pick what the logits above chose."""
    runner.release(slot)
    answer = [calls.prefill(runner, slot, prompt, GREEDY)]
    while len(answer) < length:
        answer += calls.decode(runner, [slot])
    runner.release(slot)
    return answer


@pytest.mark.default_model
def test_default_model_greedy_answers_with_ngram_speculation_equal_those_without(default_model_path):
    """Every prompt of the benchmark's sets (normal and copy, through the chat template, as served)
    and the held-out prompts above: 32 greedy tokens with n-gram proposals (2..4-grams, 4 tokens,
    the default settings) verified a step at a time equal the tokens without; the copy prompts'
    proposals are kept."""
    runtime = DEFAULT_RUNTIME.model_copy(
        update={
            "num_slots": 1,
            "max_seq_len": 1024,
            "prefill_buckets": [64, 1024],
            "decode_batch_buckets": [1, 8],  # 5 rows of logits: a token and its 4 proposals
            "attend_buckets": [1024],
        }
    )
    runner = ModelRunner.from_checkpoint(load_checkpoint(default_model_path), runtime)
    tokenizer = load_tokenizer(default_model_path)
    bench = PROJECT_ROOT / "tools" / "bench"
    sets = {
        name: [json.loads(line)["prompt"] for line in (bench / f"{name}.jsonl").read_text().splitlines()]
        for name in ("prompts", "copy_prompts")
    } | {"held_out": CHAT_PROMPTS}
    table = runner.graphs.inputs.slot_table(0)
    kept = dict.fromkeys(sets, 0)
    for name, prompts in sets.items():
        for question in prompts:
            prompt = tokenizer.encode_chat([{"role": "user", "content": question}])
            want = [calls.prefill(runner, 0, prompt, GREEDY, table)]
            while len(want) < 32:
                want += calls.decode(runner, [0], [table])
            runner.release(0)
            got, index = [calls.prefill(runner, 0, prompt, GREEDY, table)], NgramIndex(2, 4)
            while len(got) < 32:
                index.update(prompt + got)
                proposed = index.propose(prompt + got, 4)
                if proposed:
                    decoded, _ = calls.step(runner, [0], [table], [], drafts={0: proposed})
                    kept[name] += len(decoded[0]) - 1
                    got += decoded[0]
                else:
                    got += calls.decode(runner, [0], [table])
            runner.release(0)
            assert got[:32] == want, (question, tokenizer.decode(got), tokenizer.decode(want))
    assert kept["copy_prompts"] >= 32, kept
