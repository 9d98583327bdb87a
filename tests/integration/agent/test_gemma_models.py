"""Gemma 3 through the graphs: a tiny Gemma-3-shaped GGUF (tests/support/tiny_models.py
write_tiny_gemma: QK-norm, four norms a layer, GeGLU, its own head size, sliding-window local layers
with their own RoPE base, every 6th layer global, the real file's weight formats and vocabulary cut
to 1,100 tokens) against the independent numpy reference (tests/support/reference_numpy.py, written
from Gemma 3's description): logits of prompts in chunks and of decode steps, greedy answers of 32
tokens for 8 prompts (one longer than the window), at every kernel target. The window is 16
positions here (the real model's 512) so that short prompts cross it."""

import numpy as np
import pytest
from conftest import TINY_RUNTIME
from test_paged_kv import PREFILL_BUCKETS, TOLERANCE, graphs_of, prompt_ids, shuffled_tables

import reference_numpy as ref
import runner_calls as calls
from agent.contract.sampling import SamplingParams
from agent.contract.step import StepChunk
from agent.graphs.interface import bucket
from agent.model.formats import load_checkpoint
from agent.runner import ModelRunner
from tiny_models import GEMMA_WINDOW as WINDOW

# max_seq_len 64: a ring (15 + 64 positions: 5 blocks of 16) would be longer than a sequence, so the
# local layers take the pool's blocks; 128: each slot's ring of 5 blocks (interface.local_ring_blocks)
KV_LAYOUTS = {"pool": {"max_seq_len": 64}, "rings": {"max_seq_len": 128, "attend_buckets": [32, 128]}}


def chunked_prefill(graphs, table, slot: int, prompt: list[int], sizes: list[int]):
    """The prompt in chunks of `sizes` (then the rest) -> each chunk's last logits, and its end."""
    bounds = [int(b) for b in np.cumsum([0, *sizes]) if b < len(prompt)] + [len(prompt)]
    got = []
    for start, end in zip(bounds, bounds[1:]):
        length = bucket(PREFILL_BUCKETS, end - start)
        got.append(graphs.prefill(table, np.asarray(prompt[start:end]), length, start, slot).asnumpy()[0])
    return got, bounds[1:]


def test_the_tiny_files_spec_is_gemma_3s(tiny_gemma_path):
    checkpoint = load_checkpoint(tiny_gemma_path)
    spec = checkpoint.spec
    assert spec.architecture == "gemma3" and spec.head_dim == 64 and spec.num_kv_heads == 1
    assert spec.local_layers == (0, 1, 2, 3, 4) and spec.sliding_window == WINDOW
    assert spec.rope_theta == 1e6 and spec.rope_local_theta == 10000.0
    assert spec.qk_norm and spec.post_norms and spec.activation == "gelu_tanh"
    assert spec.embed_scale == pytest.approx(np.sqrt(128)) and spec.query_scale == 1 / 8
    assert {"layers.0.q_norm", "layers.0.k_norm", "layers.0.post_attn_norm", "layers.5.post_ffn_norm"} <= set(
        checkpoint.tensors
    )
    assert {m.qtype.name for m in checkpoint.blocks.values()} == {"Q5_0", "Q8_0", "Q4_K", "Q6_K"}


@pytest.mark.parametrize("layout", KV_LAYOUTS)
@pytest.mark.parametrize(
    "sizes", [[5, 11, 1], [17], [8, 8, 8, 8]], ids=["5+11+1+rest", "17+rest", "8x4+rest"]
)
def test_chunks_across_the_window_and_decode_steps_match_the_reference(
    tiny_gemma_path, kernel_target, sizes, layout
):
    """A 45-token prompt in chunks (each chunk's rows attend their own windows, reading the positions
    before the chunk from the cache), then decode steps of three sequences at once, their local
    layers' KV in the pool's blocks or in each slot's ring."""
    graphs = graphs_of(tiny_gemma_path, **KV_LAYOUTS[layout])
    assert graphs.model.stack is not None and graphs.model.local_rope
    assert graphs.inputs.ring == (5 if layout == "rings" else 0)
    reference = ref.load_gguf_reference(tiny_gemma_path)
    vocab = graphs.spec.vocab_size
    tables = shuffled_tables(graphs, 3, seed=4)
    lengths = [45, 9, 30]
    caches, tokens, diffs = [], [], []
    for slot, (table, n) in enumerate(zip(tables, lengths)):
        prompt = prompt_ids(n, 20 + slot, vocab)
        cache = ref.RefCache()
        want = ref.forward(reference, prompt, cache)
        got, ends = chunked_prefill(graphs, table, slot, prompt, sizes if slot == 0 else [])
        diffs += [float(np.abs(g - want[end - 1]).max()) for g, end in zip(got, ends)]
        caches.append(cache)
        tokens.append(int(np.argmax(want[-1])))
    positions = np.array(lengths)
    for _ in range(6):
        logits, _ = graphs.decode(tables, np.array(tokens), positions, 4, slots=[0, 1, 2])
        for i, cache in enumerate(caches):
            want = ref.forward(reference, [tokens[i]], cache)[-1]
            diffs.append(float(np.abs(logits.asnumpy()[i] - want).max()))
            tokens[i] = int(np.argmax(want))
        positions += 1
    assert max(diffs) < TOLERANCE, diffs


@pytest.mark.parametrize("layout", KV_LAYOUTS)
def test_a_mixed_step_matches_the_reference(tiny_gemma_path, layout):
    """A decode row beside a prompt chunk of 14 rows past the window (attending as products) in one
    call, each row with its own table, ring and window."""
    runtime = TINY_RUNTIME.model_copy(update=KV_LAYOUTS[layout])
    runner = ModelRunner.from_checkpoint(load_checkpoint(tiny_gemma_path), runtime)
    reference = ref.load_gguf_reference(tiny_gemma_path)
    vocab = runner.spec.vocab_size
    greedy = SamplingParams()
    first, cache = prompt_ids(20, 30, vocab), ref.RefCache()
    token = calls.prefill(runner, 0, first, greedy)
    assert token == int(np.argmax(ref.forward(reference, first, cache)[-1]))
    second = prompt_ids(30, 31, vocab)
    calls.prefill_chunk(runner, 1, second[:16], runner.graphs.inputs.slot_table(1))
    chunk = StepChunk(1, second, runner.graphs.inputs.slot_table(1), 16, greedy)
    nexts, firsts = calls.step(runner, [0], [runner.graphs.inputs.slot_table(0)], [chunk])
    assert nexts == [[int(np.argmax(ref.forward(reference, [token], cache)[-1]))]]  # a slot's tokens kept
    assert firsts == [int(np.argmax(ref.forward(reference, second, ref.RefCache())[-1]))]


def test_greedy_answers_of_8_prompts_equal_the_reference(tiny_gemma_path, kernel_target):
    """32 greedy tokens of each of 8 prompts of 3 to 60 tokens (5 longer than the window of 16; the
    longest spans four windows), one at a time through the runner (each slot's ring), equal the
    reference's."""
    runtime = TINY_RUNTIME.model_copy(update=KV_LAYOUTS["rings"])
    runner = ModelRunner.from_checkpoint(load_checkpoint(tiny_gemma_path), runtime)
    assert runner.graphs.inputs.ring and not runner.prefix_caching
    reference = ref.load_gguf_reference(tiny_gemma_path)
    vocab = runner.spec.vocab_size
    for i, n in enumerate([3, 9, 16, 17, 24, 33, 48, 60]):
        prompt = prompt_ids(n, 40 + i, vocab)
        want = ref.greedy(reference, prompt, 32)
        slot = i % runner.num_slots
        got = [calls.prefill(runner, slot, prompt, SamplingParams())]
        while len(got) < 32:
            got += calls.decode(runner, [slot])
        runner.release(slot)
        assert got == want, n


def test_speculative_steps_in_the_rings_give_the_greedy_answer(tiny_gemma_path):
    """Proposals verified in one step each (4 rows of a slot written into its ring at once), right
    ones kept and a wrong one's position written over by the next step, across the window: the
    tokens are the reference's greedy answer."""
    runtime = TINY_RUNTIME.model_copy(update=KV_LAYOUTS["rings"])
    runner = ModelRunner.from_checkpoint(load_checkpoint(tiny_gemma_path), runtime)
    reference = ref.load_gguf_reference(tiny_gemma_path)
    prompt = prompt_ids(20, 60, runner.spec.vocab_size)
    want = ref.greedy(reference, prompt, 40)
    table = runner.graphs.inputs.slot_table(0)
    got = [calls.prefill(runner, 0, prompt, SamplingParams(), table)]
    gave = []
    while len(got) < 32:
        right = want[len(got) : len(got) + 3]
        proposals = right if len(gave) % 2 == 0 else [right[0], (right[1] + 1) % runner.spec.vocab_size]
        decoded, _ = calls.step(runner, [0], [table], [], drafts={0: proposals})
        got += decoded[0]
        gave.append(len(decoded[0]))
    assert got == want[: len(got)] and gave[0] == 4 and gave[1] == 2


def test_gemma_layers_off_the_fused_kernel_are_refused(tiny_gemma_path):
    with pytest.raises(ValueError, match="run on the fused CPU kernel only"):
        graphs_of(tiny_gemma_path, matmul="mindspore")
