"""Pooling requests on the runner (SamplingParams.pool): a prompt's last row returns its final hidden
state or its logits of given tokens, against independent references on tiny Qwen3 models with
Qwen3's real vocabulary (tests/support/pooling_models.py): sentence-transformers' embeddings of the
Hugging Face directory (last-token pooling, normalized), from that directory and from its GGUF, and
transformers' logits for a reranker's labels; the same vector whether the prompt runs alone, in
chunks, from a prefix-cache hit or in one mixed step beside a decoding sequence, whose tokens it
leaves as they were; and int8 activations (the default on quantized files) against float32. An
encoder (EmbeddingGemma's shape: bidirectional attention, mean pooling, dense projections) against
sentence-transformers, several inputs in one step as each alone; its known-answer reference (the
numpy forward) against transformers' hidden states."""

import json
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch
from conftest import DEFAULT_RUNTIME

import hf_reference as hf
import pooling_models
import runner_calls as calls
from agent.contract.sampling import SamplingParams
from agent.contract.step import StepChunk, StepRequest
from agent.known_answer import numpy_forward
from agent.model.checkpoint import CheckpointError
from agent.model.formats import load_checkpoint
from agent.model.tokenizer import load_tokenizer
from agent.runner import ModelRunner, RunnerError
from server.pooling import Pooling, embedding

FLOAT32_COSINE = 0.99999  # the bound in float32 mode
INT8_COSINE = 0.999  # and on defaults
HIDDEN = SamplingParams(pool="hidden")
NORMALIZED = Pooling("last", 64)


@pytest.fixture(scope="module")
def embedder(tmp_path_factory):
    return pooling_models.write_embedder(tmp_path_factory.mktemp("embedder"))


@pytest.fixture(scope="module")
def texts() -> list[str]:
    suite = hf.suite_texts(pooling_models.FAMILY)
    return ["The capital of France is", " ".join(suite)[:400], *suite[3:8]]


def pooled(
    runner: ModelRunner, slot: int, ids: list[int], params: SamplingParams = HIDDEN, **chunk
) -> np.ndarray:
    reply = runner.execute(StepRequest(chunks=[calls.chunk(slot, ids, params, **chunk)]))
    return reply.pooled[0]


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.dot(a, b) / (np.linalg.norm(a) * np.linalg.norm(b)))


def test_embeddings_equal_sentence_transformers_from_the_directory_and_the_gguf(embedder, texts):
    from sentence_transformers import SentenceTransformer

    directory, gguf, _ = embedder
    reference = SentenceTransformer(str(directory), device="cpu")
    want = reference.encode(texts, convert_to_numpy=True, batch_size=1)
    ids = [reference.preprocess([t])["input_ids"][0].tolist() for t in texts]
    assert max(len(i) for i in ids) > 128  # past the smallest prefill bucket: more than one piece
    for path in (directory, gguf):
        runner = ModelRunner.from_checkpoint(load_checkpoint(path), DEFAULT_RUNTIME)
        for prompt, vector in zip(ids, want):
            got = embedding(pooled(runner, 0, prompt), NORMALIZED, None)
            runner.release(0)
            assert cosine(got, vector) >= FLOAT32_COSINE, (path.name, len(prompt))
            assert np.abs(got - vector).max() < 1e-4


def test_label_logits_equal_transformers(tmp_path):
    gguf, model = pooling_models.write_reranker(tmp_path)
    tokenizer = load_tokenizer(gguf)
    labels = tuple(tokenizer.tokenizer.token_to_id(t) for t in ("yes", "no"))
    runner = ModelRunner.from_checkpoint(load_checkpoint(gguf), DEFAULT_RUNTIME)
    for document in ("Paris is the capital of France.", "Bananas are yellow."):
        prompt = tokenizer.encode(
            f"<Query>: capital of France\n<Document>: {document}", add_special_tokens=False
        )
        with torch.no_grad():
            want = model(torch.tensor([prompt])).logits[0, -1, list(labels)].numpy()
        got = pooled(runner, 0, prompt, SamplingParams(pool=labels))
        runner.release(0)
        assert got.shape == (2,) and np.abs(got - want).max() < 1e-4, (got, want)


def test_a_pooled_prompt_in_chunks_from_a_cache_hit_and_mixed_with_a_decode(embedder, texts):
    """The long text's vector computed whole, in two chunks, and from the chunked slot's cached
    blocks (a prefix-cache hit) as the chunk of a mixed step beside a decoding slot: the same vector
    each time, and the decoding slot's tokens those of its decode alone."""
    _, gguf, _ = embedder
    ids = load_tokenizer(gguf).encode(texts[1])[:150]
    runner = ModelRunner.from_checkpoint(load_checkpoint(gguf), DEFAULT_RUNTIME)
    inputs = runner.graphs.inputs
    decoding = inputs.slot_table(0)
    whole = pooled(runner, 0, ids, table=decoding)
    runner.release(0)

    first = inputs.slot_table(1)
    calls.prefill_chunk(runner, 1, ids[:64], first)
    chunked = pooled(runner, 1, ids, table=first, start=64)
    np.testing.assert_allclose(chunked, whole, rtol=0, atol=1e-5)

    prompt = ids[:20]
    alone = [calls.prefill(runner, 0, prompt, SamplingParams(), decoding)]
    alone += [calls.decode(runner, [0], [decoding])[0] for _ in range(3)]
    runner.release(0)
    got = [calls.prefill(runner, 0, prompt, SamplingParams(), decoding)]
    second = inputs.slot_table(2)
    shared = 128 // DEFAULT_RUNTIME.block_size
    second[:shared] = first[:shared]
    hit = StepChunk(2, ids, second, 128, HIDDEN)
    reply = runner.execute(StepRequest([0], [decoding], [hit]))
    got.append(reply.decoded[0][0].token)
    got += [calls.decode(runner, [0], [decoding])[0] for _ in range(2)]
    assert got == alone
    np.testing.assert_allclose(reply.pooled[0], whole, rtol=0, atol=1e-5)


def test_int8_activations_keep_embeddings_within_the_bound(tmp_path, texts):
    """A quantized embedder (Q8_0 and Q4_K layers, int8 activations by default) against the same
    file in float32 activations: the quality the defaults give."""
    path = tmp_path / "q.gguf"
    tokenizer_file = hf.vocabulary_path(pooling_models.FAMILY)
    shape = [
        "--arch",
        "qwen3",
        "--hidden",
        "256",
        "--layers",
        "2",
        "--ffn",
        "512",
        "--heads",
        "4",
        "--kv-heads",
        "2",
    ]
    subprocess.run(
        [
            sys.executable,
            "-m",
            "tools.make_gguf",
            *shape,
            "--format",
            "Q4_K_M",
            "--tokenizer",
            str(tokenizer_file),
            "--out",
            str(path),
        ],
        check=True,
        capture_output=True,
    )
    tokenizer = load_tokenizer(path)
    default, exact = (
        ModelRunner.from_checkpoint(
            load_checkpoint(path), DEFAULT_RUNTIME.model_copy(update={"activations": a})
        )
        for a in ("int8", "float32")
    )
    for text in texts:
        ids = tokenizer.encode(text)
        got, want = pooled(default, 0, ids), pooled(exact, 0, ids)
        default.release(0)
        exact.release(0)
        assert cosine(got, want) >= INT8_COSINE, len(ids)


@pytest.fixture(scope="module")
def encoder(tmp_path_factory):
    return pooling_models.write_gemma_embedder(tmp_path_factory.mktemp("encoder"))


def encoder_texts() -> list[str]:
    """Texts of 2 to ~200 tokens: most longer than the local layers' window (8 either side)."""
    suite = hf.suite_texts("mistral")
    return ["Paris is the capital of France.", "a", " ".join(suite)[:400], *suite[2:6]]


@pytest.mark.parametrize("form", ["directory", "gguf"])
def test_an_encoder_s_embeddings_equal_sentence_transformers(encoder, form):
    """Mean pooling over every row of the prompt, each row attending the whole prompt (within the
    local layers' window either side), then both projections: sentence-transformers' vector, from
    its own directory (the Dense modules read from it) and from the GGUF. The prompts run whole: the
    runner says it takes no chunks, and refuses a chunk that starts later."""
    directory, gguf, reference = encoder
    texts = encoder_texts()
    want = reference.encode(texts, convert_to_numpy=True, batch_size=1)
    ids = [reference.preprocess([t])["input_ids"][0].tolist() for t in texts]
    assert max(len(i) for i in ids) > 64 and min(len(i) for i in ids) <= 2
    runner = ModelRunner.from_checkpoint(
        load_checkpoint(gguf if form == "gguf" else directory), DEFAULT_RUNTIME
    )
    assert not runner.chunked_prefill and not runner.prefix_caching
    mean = SamplingParams(pool="mean")
    alone = []
    for prompt, vector in zip(ids, want):
        alone.append(pooled(runner, 0, prompt, mean))
        runner.release(0)
        got = embedding(alone[-1], NORMALIZED, None)
        assert cosine(got, vector) >= FLOAT32_COSINE, len(prompt)
        assert np.abs(got - vector).max() < 1e-5
    # the three shortest inputs in one step (one call of the mixed graph): each as it was alone
    shortest = sorted(range(len(ids)), key=lambda i: len(ids[i]))[:3]
    assert sum(len(ids[i]) for i in shortest) <= runner.mixed_rows
    chunks = [calls.chunk(slot, ids[i], mean) for slot, i in enumerate(shortest)]
    reply = runner.execute(StepRequest(chunks=chunks))
    for vector, i in zip(reply.pooled, shortest):
        np.testing.assert_allclose(vector, alone[i], rtol=0, atol=1e-5)
    for slot in range(3):
        runner.release(slot)
    with pytest.raises(RunnerError, match="whole prompt"):
        pooled(runner, 1, ids[2], mean, table=runner.graphs.inputs.slot_table(1), start=16)
    # its graphs run no LM head: zero logits, the hidden states all there (what warm-up checked)
    logits = runner.graphs.prefill(runner.graphs.inputs.scratch_table, np.array(ids[0]), 64).asnumpy()
    assert not logits.any() and np.abs(runner.graphs.hidden.asnumpy()[: len(ids[0])]).max(axis=1).all()


def test_an_encoder_s_known_answer_is_transformers_bidirectional_forward(encoder):
    """The warm-up's reference (numpy_forward) of an encoder: its prompt's last row's logits are
    transformers' final hidden state of that row times the embedding (the hidden states are
    bidirectional: changing the last token changes the first row's)."""
    _, gguf, reference = encoder
    ids = reference.preprocess(["The quick brown fox jumps over the lazy dog, twice over."])["input_ids"]
    prompt = ids[0].tolist()
    checkpoint = load_checkpoint(gguf)
    transformer = reference[0].auto_model
    with torch.no_grad():
        hidden = transformer(input_ids=ids).last_hidden_state[0].numpy()
        changed = transformer(input_ids=torch.tensor([prompt[:-1] + [prompt[-1] + 1]])).last_hidden_state
    assert np.abs(changed[0, 0].numpy() - hidden[0]).max() > 1e-4
    logits, _, _ = numpy_forward(checkpoint, np.array(prompt + [5]), states_at=len(prompt))
    want = hidden @ checkpoint.matrix("embed").T
    np.testing.assert_allclose(logits[: len(prompt)], want, rtol=0, atol=1e-3 * np.abs(want).max())
    # what an encoder's graphs are held to at warm-up (they run no LM head): the hidden states
    normed, _, _ = numpy_forward(checkpoint, np.array(prompt + [5]), states_at=len(prompt), final_hidden=True)
    np.testing.assert_allclose(normed[: len(prompt)], hidden, rtol=0, atol=1e-4 * np.abs(hidden).max())


def test_a_dense_module_with_a_bias_or_an_activation_is_refused(encoder, tmp_path):
    directory, _, _ = encoder
    for i, change in enumerate(({"bias": True}, {"activation_function": "torch.nn.modules.activation.Tanh"})):
        copy = tmp_path / str(i)
        shutil.copytree(directory, copy)
        config_path = copy / "3_Dense" / "config.json"
        config_path.write_text(json.dumps(json.loads(config_path.read_text()) | change))
        with pytest.raises(CheckpointError, match="3_Dense: a Dense module with a bias or the activation"):
            load_checkpoint(copy)
