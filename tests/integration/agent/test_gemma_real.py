"""The real Gemma 3 270M file (Q4_K_M: Q5_0, Q4_K, Q6_K, Q8_0 matrices kept in their formats) through
the graphs against the independent numpy reference (tests/support/reference_numpy.py: float64, the
same tensors dequantized by the gguf package, Gemma 3's forward written from its description).
`make test-long` (marked long): the reference takes about a second a token for this model.

It is the base (pretrained) model: completion prompts, no chat template."""

import numpy as np
import pytest
from conftest import TINY_RUNTIME

import reference_numpy as ref
import runner_calls as calls
from agent.contract.sampling import SamplingParams
from agent.model.formats import load_checkpoint
from agent.model.tokenizer import load_tokenizer
from agent.runner import ModelRunner

pytestmark = pytest.mark.long

LONG_PROMPT = "".join(
    f"Day {i}: the weather was {('sunny', 'rainy', 'windy', 'cold')[i % 4]}, and the market sold "
    f"{i * 7 % 50 + 10} apples and {i * 3 % 20 + 5} pears.\n"
    for i in range(1, 36)
)
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea,",
    "The three primary colors are",
    "import numpy as np\n\n# the mean of a list of numbers\ndef mean(values):",
    "北京是中国的",
    "Water boils at a temperature of",
    LONG_PROMPT,  # about 800 tokens: longer than the local layers' window of 512
]
RUNTIME = TINY_RUNTIME.model_copy(
    update={
        "num_slots": 2,
        "max_seq_len": 2048,  # each slot's ring (64 blocks) is shorter than a sequence: rings on
        "prefill_buckets": [32, 128, 512],
        "decode_batch_buckets": [1, 2],
        "attend_buckets": [2048],
    }
)


@pytest.fixture(scope="module")
def gemma_runner(gemma_model_path) -> ModelRunner:
    checkpoint = load_checkpoint(gemma_model_path)
    assert not checkpoint.tensors.keys() & {f"layers.0.{m}" for m in ("wq", "wk", "wv", "wo", "w_down")}
    return ModelRunner.from_checkpoint(checkpoint, RUNTIME)


@pytest.fixture(scope="module")
def gemma_reference(gemma_model_path) -> ref.RefModel:
    return ref.load_gguf_reference(gemma_model_path)


def test_the_real_files_greedy_answers_equal_the_reference(gemma_runner, gemma_reference, gemma_model_path):
    """8 completion prompts, 32 greedy tokens each; the last prompt is longer than the window."""
    tokenizer = load_tokenizer(gemma_model_path)
    assert gemma_runner.graphs.inputs.ring == 64 and not gemma_runner.prefix_caching
    answers = []
    for i, text in enumerate(PROMPTS):
        prompt = tokenizer.encode(text)
        assert (len(prompt) > 512) == (text is LONG_PROMPT)
        want = ref.greedy(gemma_reference, prompt, 32)
        got = [calls.prefill(gemma_runner, i % 2, prompt, SamplingParams())]
        while len(got) < 32:
            got += calls.decode(gemma_runner, [i % 2])
        gemma_runner.release(i % 2)
        answers.append(tokenizer.decode(got))
        assert got == want, (text[:40], tokenizer.decode(got), tokenizer.decode(want))
    assert "Paris" in answers[0] or "France" in answers[0], answers[0]
    assert "return" in answers[1] or "fibonacci" in answers[1], answers[1]


def test_the_real_files_logits_equal_the_reference(gemma_runner, gemma_reference, gemma_model_path):
    """The prompt's last logits and 4 decode steps', to 1e-3 of the largest."""
    prompt = load_tokenizer(gemma_model_path).encode(PROMPTS[0])
    cache = ref.RefCache()
    table = gemma_runner.graphs.inputs.slot_table(0)
    got = gemma_runner.graphs.prefill(table, np.asarray(prompt), 32, slot=0).asnumpy()[0]
    want = ref.forward(gemma_reference, prompt, cache)[-1]
    diffs = [float(np.abs(got - want).max() / np.abs(want).max())]
    token, position = int(np.argmax(want)), len(prompt)
    for _ in range(4):
        logits, _ = gemma_runner.graphs.decode(
            table[None, :], np.array([token]), np.array([position]), 1, slots=[0]
        )
        want = ref.forward(gemma_reference, [token], cache)[-1]
        diffs.append(float(np.abs(logits.asnumpy()[0] - want).max() / np.abs(want).max()))
        token, position = int(np.argmax(want)), position + 1
    assert max(diffs) < 1e-3, diffs
