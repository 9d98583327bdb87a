"""runtime.activations int8 keeps a request's tokens its own (issue 58): the default model's greedy
answers are the same alone, in decode batches of every size, and beside other prompts and proposals
in mixed steps. A row's int8 products sum alike at every row count (int8_products.h). A prompt's
chunking still moves its answer: its rows attend as products in runs of 8 rows or more and one by
one in shorter ones (prompt_attention.h), in float32 too, which int8's rounding makes visible."""

import pytest

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


def runner_and_prompts(path) -> tuple[ModelRunner, list[list[int]]]:
    tokenizer = load_tokenizer(path)
    prompts = [tokenizer.encode_chat([{"role": "user", "content": q}]) for q in QUESTIONS]
    return ModelRunner.from_checkpoint(load_checkpoint(path), INT8_RUNTIME), prompts


def decode(runner: ModelRunner, slots: list[int], out: dict[int, list[int]]) -> None:
    for slot, token in zip(slots, runner.decode(slots, [TABLES[s] for s in slots])):
        out[slot].append(token)


def alone(runner: ModelRunner, prompt: list[int], slot: int) -> list[int]:
    """The answer of one sequence alone."""
    out = {slot: [runner.prefill(slot, prompt, GREEDY, TABLES[slot])]}
    while len(out[slot]) < ANSWER:
        decode(runner, [slot], out)
    runner.release(slot)
    return out[slot]


def batched(runner: ModelRunner, prompts: list[list[int]]) -> list[list[int]]:
    """Each prompt alone, then all their answers decoded together."""
    out = {s: [runner.prefill(s, p, GREEDY, TABLES[s])] for s, p in enumerate(prompts)}
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
        decoded, (first,) = runner.step(slots, [TABLES[s] for s in slots], [chunk], drafts=drafts)
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
def test_int8_answers_alone_equal_those_in_batches_and_mixed_steps(default_model_path):
    assert_answers_are_their_own(*runner_and_prompts(default_model_path))
