"""runtime.activations int8 keeps a request's tokens its own (issue 58): the default model's greedy
answers are the same alone, in decode batches of every size, beside other prompts and proposals in
mixed steps, with the prompt computed in chunks of any size (alone or beside decode rows) and after
a prefix-cache hit. A row's int8 products sum alike at every row count (int8_products.h), and a
row's attention alike in a block of rows or alone, its keys written in the same call or an earlier
one (row_ops.h attend_rows): before, a prompt's rows attended as products over all their keys, and
chunking or a prefix hit changed 1 of the 8 answers."""

import pytest

import runner_calls as calls
from agent.contract.sampling import SamplingParams
from agent.contract.step import StepChunk
from agent.model.formats import load_checkpoint
from agent.model.tokenizer import load_tokenizer
from agent.runner import ModelRunner
from config.schema import RuntimeSection

# 8 slots of 96 positions in blocks of 16 (6 a table, 48 in the pool); mixed steps of 64 rows
INT8_RUNTIME = RuntimeSection(
    num_slots=8,
    max_seq_len=96,
    block_size=16,
    prefill_buckets=[64],
    decode_batch_buckets=[1, 2, 4, 8],
    attend_buckets=[96],
    activations="int8",
    compile_cache_dir=None,
)
GREEDY = SamplingParams()
ANSWER = 12
QUESTIONS = [
    "What is the capital of France?",
    "Say hello in three languages, please.",
    "Why is the sky blue?",
    "Name a prime number larger than ten and explain why it is prime.",
    "Write a haiku about the sea.",
    "How many legs does a spider have?",
    "Give me two tips for sleeping better at night, briefly.",
    "What is 12 times 11?",
]
TABLES = [list(range(6 * i, 6 * i + 6)) for i in range(len(QUESTIONS))]


def runner_and_prompts(path, activations: str = "int8") -> tuple[ModelRunner, list[list[int]]]:
    tokenizer = load_tokenizer(path)
    prompts = [tokenizer.encode_chat([{"role": "user", "content": q}]) for q in QUESTIONS]
    runtime = RuntimeSection.model_validate({**INT8_RUNTIME.model_dump(), "activations": activations})
    return ModelRunner.from_checkpoint(load_checkpoint(path), runtime), prompts


def decode(runner: ModelRunner, slots: list[int], out: dict[int, list[int]]) -> None:
    for slot, token in zip(slots, calls.decode(runner, slots, [TABLES[s] for s in slots])):
        out[slot].append(token)


def alone(runner: ModelRunner, prompt: list[int], slot: int) -> list[int]:
    """The answer of one sequence alone."""
    out = {slot: [calls.prefill(runner, slot, prompt, GREEDY, TABLES[slot])]}
    while len(out[slot]) < ANSWER:
        decode(runner, [slot], out)
    runner.release(slot)
    return out[slot]


def batched(runner: ModelRunner, prompts: list[list[int]]) -> list[list[int]]:
    """Each prompt alone, then all their answers decoded together."""
    out = {s: [calls.prefill(runner, s, p, GREEDY, TABLES[s])] for s, p in enumerate(prompts)}
    while len(out[0]) < ANSWER:
        decode(runner, list(out), out)
    for slot in out:
        runner.release(slot)
    return list(out.values())


def staggered(runner: ModelRunner, prompts: list[list[int]], proposals: list[list[int]]) -> list[list[int]]:
    """A prompt a step arrives inside a mixed step beside the decode rows of those before it, slot 0
    proposing the next two tokens of `proposals[0]` (its answer alone, the first right, the second
    wrong): decode rows, proposals and a prompt's rows in one call."""
    out: dict[int, list[int]] = {}
    while len(out) < len(prompts) or any(len(answer) < ANSWER for answer in out.values()):
        slots = [s for s, answer in out.items() if len(answer) < ANSWER]
        slot = len(out)
        if slot == len(prompts):
            decode(runner, slots, out)
            continue
        chunk = StepChunk(slot, prompts[slot], TABLES[slot], 0, GREEDY)
        known = out.get(0, [])
        drafts = {}
        if 0 in slots and len(known) + 3 <= ANSWER:
            drafts[0] = [proposals[0][len(known)], proposals[0][len(known) + 1] + 1]
        decoded, (first,) = calls.step(runner, slots, [TABLES[s] for s in slots], [chunk], drafts=drafts)
        for s, tokens in zip(slots, decoded):
            out[s] += tokens[: ANSWER - len(out[s])]
        assert first is not None
        out[slot] = [first]
    for slot in out:
        runner.release(slot)
    return [out[s] for s in range(len(prompts))]


def assert_answers_are_their_own(runner: ModelRunner, prompts: list[list[int]]) -> None:
    assert len({len(p) for p in prompts}) >= 6 and max(map(len, prompts)) + ANSWER <= 96
    solo = [alone(runner, p, s) for s, p in enumerate(prompts)]
    assert len({tuple(answer) for answer in solo}) == len(solo)  # each prompt's own answer
    for size in range(1, len(prompts) + 1):
        assert batched(runner, prompts[:size]) == solo[:size], f"a batch of {size}"
    assert staggered(runner, prompts, solo) == solo


@pytest.mark.default_model
def test_int8_answers_alone_equal_those_in_batches_and_mixed_steps(default_model_path, int8_kernel_target):
    """At every kernel target with int8 products (AVX-512 VNNI's and AVX2's on an AVX-512 machine)."""
    assert_answers_are_their_own(*runner_and_prompts(default_model_path))


def finish(runner: ModelRunner, slot: int, first: int) -> list[int]:
    """An occupied slot's answer from its first token, decoded alone."""
    out = {slot: [first]}
    while len(out[slot]) < ANSWER:
        decode(runner, [slot], out)
    runner.release(slot)
    return out[slot]


def chunked(runner: ModelRunner, prompt: list[int], slot: int, size: int) -> list[int]:
    """The prompt's positions `size` at a time, each chunk its own call."""
    ends = list(range(size, len(prompt), size))
    for start, end in zip([0, *ends], ends):
        calls.prefill_chunk(runner, slot, prompt[:end], TABLES[slot], start)
    return finish(
        runner, slot, calls.prefill(runner, slot, prompt, GREEDY, TABLES[slot], ends[-1] if ends else 0)
    )


def after_prefix_hit(runner: ModelRunner, prompt: list[int], slot: int, cached: int) -> list[int]:
    """The prompt again from position `cached`: its positions before it are in its blocks from
    the earlier call that computed the whole prompt (a prefix-cache hit's reuse)."""
    return finish(runner, slot, calls.prefill(runner, slot, prompt, GREEDY, TABLES[slot], cached))


def chunked_beside_decodes(runner: ModelRunner, prompts: list[list[int]], size: int) -> list[list[int]]:
    """Slot 0 decodes alone; each later prompt arrives in chunks of `size` inside mixed steps beside
    the decode rows of those already answering."""
    out = {0: [calls.prefill(runner, 0, prompts[0], GREEDY, TABLES[0])]}
    for slot in range(1, len(prompts)):
        prompt, start = prompts[slot], 0
        while True:
            end = min(start + size, len(prompt))
            last = end == len(prompt)
            chunk = StepChunk(slot, prompt[:end], TABLES[slot], start, GREEDY if last else None)
            slots = [s for s, answer in out.items() if len(answer) < ANSWER]
            decoded, (first,) = calls.step(runner, slots, [TABLES[s] for s in slots], [chunk])
            for s, tokens in zip(slots, decoded):
                out[s] += tokens[: ANSWER - len(out[s])]
            if last:
                assert first is not None
                out[slot] = [first]
                break
            start = end
    while any(len(answer) < ANSWER for answer in out.values()):
        decode(runner, [s for s, answer in out.items() if len(answer) < ANSWER], out)
    for slot in out:
        runner.release(slot)
    return [out[s] for s in range(len(prompts))]


@pytest.mark.default_model
def test_int8_answers_do_not_depend_on_chunking_or_prefix_hits(default_model_path, int8_kernel_target):
    """Chunks of 1, 3, 8 and 13 positions (runs of rows shorter and longer than an attention block
    of 8), a prefix hit at a block boundary (16) and mid-prompt-block counts, and chunks inside
    mixed steps: every answer equals the prompt's computed whole (before the attention's blocks
    of rows summed as a row alone does, with int8 5 to 7 of the 8 did). At every kernel target with
    int8 products."""
    assert_answers_do_not_depend_on_chunking(*runner_and_prompts(default_model_path, "int8"))


@pytest.mark.default_model
def test_float32_answers_do_not_depend_on_chunking_or_prefix_hits(default_model_path):
    assert_answers_do_not_depend_on_chunking(*runner_and_prompts(default_model_path, "float32"))


def assert_answers_do_not_depend_on_chunking(runner: ModelRunner, prompts: list[list[int]]) -> None:
    solo = [alone(runner, p, s) for s, p in enumerate(prompts)]
    assert len({tuple(answer) for answer in solo}) == len(solo)
    for size in (1, 3, 8, 13):
        assert [chunked(runner, p, s, size) for s, p in enumerate(prompts)] == solo, f"chunks of {size}"
    for cached in (16, 9):
        assert all(len(p) > cached for p in prompts)
        answers = [after_prefix_hit(runner, p, s, cached) for s, p in enumerate(prompts)]
        assert answers == solo, f"a prefix hit of {cached}"
    for size in (5, 11):
        assert chunked_beside_decodes(runner, prompts, size) == solo, f"chunks of {size} in mixed steps"
