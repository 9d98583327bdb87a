"""runtime.kv_cache_dtype: q8_0 on the default model against the independent numpy reference
(tests/support/reference_numpy.py): the warm-up's known-answer check (prefill, decode and mixed
steps, the KV transfer graphs) passes, prefill and decode logits agree with the reference reading the
same cache, whose rows are gguf's Q8_0 of the reference's K and V; the cache takes 34 bytes for 32
values; a prompt's blocks moved out and back (the tiers' moves) answer alike."""

import numpy as np
import pytest
from conftest import DEFAULT_RUNTIME

import reference_numpy as ref
import runner_calls as calls
from agent.contract import protocol
from agent.contract.sampling import SamplingParams
from agent.graphs.cache_format import dequantize_rows, quantize_rows
from agent.known_answer import KnownAnswer
from agent.kv_tier_moves import export_blocks, import_blocks, tier_layout
from agent.kv_transfer import export_kv
from agent.model.formats import load_checkpoint
from agent.model.tokenizer import load_tokenizer
from agent.runner import ModelRunner
from agent.service import AgentService
from agent.warm_up import warm_up
from config.schema import RuntimeSection
from scheduler.speculation.ngram import NgramIndex

pytestmark = pytest.mark.default_model
GREEDY = SamplingParams()
QUESTIONS = ["What is the capital of France?", "Write a haiku about the sea."]
# Float32 activations: the int8 ones round each product's input, which the reference then must too.
Q8_RUNTIME = DEFAULT_RUNTIME.model_copy(update={"kv_cache_dtype": "q8_0", "activations": "float32"})


@pytest.fixture(scope="module")
def q8_runner(default_model_path) -> ModelRunner:
    checkpoint = load_checkpoint(default_model_path)
    runner = ModelRunner.from_checkpoint(checkpoint, Q8_RUNTIME)
    warm_up(runner, lambda line: None, known=KnownAnswer.of_checkpoint(checkpoint, Q8_RUNTIME))
    return runner


def greedy(runner: ModelRunner, slot: int, prompt: list[int], n: int) -> list[int]:
    got = [calls.prefill(runner, slot, prompt, GREEDY)]
    while len(got) < n:
        got += calls.decode(runner, [slot])
    return got


def test_the_cache_is_q8_0_rows_of_34_bytes_for_32_values(q8_runner, default_model_path):
    spec = q8_runner.spec
    layer = q8_runner.graphs.model.layers[0]
    assert str(layer.k_cache.dtype).lower() == "uint8"
    assert tuple(layer.k_cache.shape)[1] == spec.head_dim // 32 * 34
    float_runtime = DEFAULT_RUNTIME.model_copy(update={"activations": "float32"})
    plain = ModelRunner.from_checkpoint(load_checkpoint(default_model_path), float_runtime)
    assert q8_runner.graphs.cache_bytes() * 128 == plain.graphs.cache_bytes() * 34


def as_reference(k: np.ndarray, interleaved: bool) -> np.ndarray:
    """K rows in the checkpoint's rotate-half order -> the reference's (a GGUF's interleaved pairs)."""
    if not interleaved:
        return k
    half = k.shape[-1] // 2
    return np.stack([k[..., :half], k[..., half:]], axis=-1).reshape(k.shape)


def as_checkpoint(k: np.ndarray, interleaved: bool) -> np.ndarray:
    if not interleaved:
        return k
    return np.concatenate([k[..., 0::2], k[..., 1::2]], axis=-1)


def held_rows(runner: ModelRunner, table: np.ndarray, length: int, interleaved: bool):
    """Positions 0..length-1 of the cache as each layer's (K, V) [length, KV, hd], dequantized, K in
    the reference's order."""
    held = dequantize_rows(runner.kv_graphs().kv_export(table, 64)[:, :, :length]).transpose(0, 2, 1, 3)
    return [(as_reference(held[2 * i], interleaved), held[2 * i + 1]) for i in range(len(held) // 2)]


def test_prefill_and_decode_over_the_cache_they_wrote_match_the_reference(q8_runner, default_model_path):
    """A q8_0 rounding flips with the last float bit of its input, and one flipped quant moves this
    model's logits by up to ~0.2 (measured: K and V perturbed by 1e-7 before rounding), so the
    reference attends to the rows the agent's cache holds (RefCache.read) and is held to float32's
    1e-3; those rows must be gguf's Q8_0 of the K and V the reference computes, a rare flip aside."""
    reference = ref.load_gguf_reference(default_model_path)
    tokenizer = load_tokenizer(default_model_path)
    prompt = tokenizer.encode_chat([{"role": "user", "content": QUESTIONS[0]}])
    n = len(prompt)
    table = q8_runner.graphs.inputs.slot_table(3)
    prefill = q8_runner.graphs.prefill(table, np.asarray(prompt), 64).asnumpy()[0]
    interleaved = reference.interleaved_rope
    cache = ref.RefCache(read=held_rows(q8_runner, table, n, interleaved))
    want = ref.forward(reference, prompt, cache)[-1]
    assert np.abs(prefill - want).max() < 1e-3
    computed = []
    for k, v in zip(cache.keys, cache.values):
        computed += [as_checkpoint(np.stack(k), interleaved), np.stack(v)]
    stored = q8_runner.kv_graphs().kv_export(table, 64)[:, :, :n].transpose(0, 2, 1, 3)
    same = (quantize_rows(np.stack(computed)) == stored).all(axis=-1).mean()
    assert same > 0.99, same
    plain = ref.forward(reference, prompt, ref.RefCache())[-1]
    assert np.abs(want - plain).max() > 1e-2  # the rounding did move the logits

    token = int(np.argmax(prefill))
    logits, _ = q8_runner.graphs.decode(table[None, :], np.array([token]), np.array([n]), 1, 256)
    cache = ref.RefCache(read=held_rows(q8_runner, table, n + 1, interleaved))
    want = ref.forward(reference, [*prompt, token], cache)[-1]
    assert np.abs(logits.asnumpy()[0] - want).max() < 1e-3


def test_a_prompts_q8_0_blocks_moved_out_and_back_answer_alike(q8_runner, default_model_path, release_all):
    """The tiers' moves (export_blocks / import_blocks through the KV transfer graphs) carry a
    q8_0 cache's bytes: a prompt's blocks copied into other pool blocks decode the same tokens."""
    release_all(q8_runner)
    tokenizer = load_tokenizer(default_model_path)
    prompt = tokenizer.encode_chat([{"role": "user", "content": QUESTIONS[1]}])
    layout = tier_layout(q8_runner)
    assert layout.dtype == "uint8" and layout.row_width == q8_runner.spec.head_dim // 32 * 34
    want = greedy(q8_runner, 0, prompt, 8)
    source = q8_runner.slots[0].table
    kvs = export_blocks(q8_runner, [int(b) for b in source[: len(prompt) // 16]])
    assert all(kv.dtype == np.uint8 and kv.shape == layout.shape for kv in kvs)
    q8_runner.release(0)
    # the same prompt in slot 1, its whole blocks imported rather than computed: its first token
    # then comes from the rest of the prompt after them
    table = q8_runner.graphs.inputs.slot_table(1)
    import_blocks(q8_runner, [int(b) for b in table[: len(kvs)]], kvs)
    cached = len(kvs) * 16
    first = calls.prefill(q8_runner, 1, prompt, GREEDY, table, start=cached)
    got = [first]
    while len(got) < 8:
        got += calls.decode(q8_runner, [1])
    assert got == want


def test_pd_transfer_moves_the_q8_0_rows_and_the_receiver_decodes_alike(
    q8_runner, default_model_path, release_all
):
    """export_kv and the kv_receive op (PD disaggregation's frames through the wire protocol, into the
    agent service) of a q8_0 cache: the frame is its uint8 rows, a float32 frame is refused, and the
    moved sequence goes on as at home."""
    release_all(q8_runner)
    tokenizer = load_tokenizer(default_model_path)
    prompt = tokenizer.encode_chat([{"role": "user", "content": QUESTIONS[0]}])
    calls.prefill(q8_runner, 0, prompt, GREEDY)
    blocks, _, state = export_kv(q8_runner, 0)
    assert blocks.dtype == np.uint8 and blocks.shape[-1] == q8_runner.cache_row_width()
    at_home = [calls.decode(q8_runner, [0])[0] for _ in range(8)]
    q8_runner.release(0)
    service = AgentService(q8_runner, model_name="default", rank=0, port=0, role="decode")
    service.handle(protocol.encode({"op": "reset", "id": 0, "session": 7}))

    def receive(frame: np.ndarray) -> dict:
        request = {"op": "kv_receive", "id": 1, "session": 7, "slot": 2, "ticket": 1, "state": state}
        table = np.arange(8, 12, dtype=np.int32)  # 4 blocks of 16 positions
        return protocol.decode(service.handle(protocol.encode(request, [frame, table])))[0]

    refused = receive(dequantize_rows(blocks))
    assert not refused["ok"] and "do not fit" in refused["error"]
    assert receive(blocks)["ok"]
    assert [calls.decode(q8_runner, [2])[0] for _ in range(8)] == at_home


def test_speculation_verifies_over_a_q8_0_cache_as_decoding_does(q8_runner, default_model_path, release_all):
    """Proposed tokens verified a step at a time (their rows write and read the q8_0 cache) give the
    tokens plain decoding gives, on a prompt that copies its input."""
    release_all(q8_runner)
    tokenizer = load_tokenizer(default_model_path)
    text = "red green blue red green blue red green blue"
    prompt = tokenizer.encode_chat([{"role": "user", "content": f"Repeat exactly: {text}"}])
    table = q8_runner.graphs.inputs.slot_table(1)
    want = greedy(q8_runner, 1, prompt, 24)
    q8_runner.release(1)
    got, index, kept = [calls.prefill(q8_runner, 1, prompt, GREEDY, table)], NgramIndex(2, 4), 0
    while len(got) < 24:
        index.update(prompt + got)
        proposed = index.propose(prompt + got, 3)
        if proposed:
            decoded, _ = calls.step(q8_runner, [1], [table], [], drafts={1: proposed})
            kept += len(decoded[0]) - 1
            got += decoded[0]
        else:
            got += calls.decode(q8_runner, [1], [table])
    assert got[:24] == want and kept > 0


def test_q8_0_needs_the_fused_kernel():
    with pytest.raises(ValueError, match="kv_cache_dtype: q8_0 is written and read by the fused CPU layer"):
        RuntimeSection(kv_cache_dtype="q8_0", decode_attention="gather")
