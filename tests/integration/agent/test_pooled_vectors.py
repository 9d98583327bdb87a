"""Pooling requests on the runner (SamplingParams.pool): a prompt's last row returns its final hidden
state or its logits of given tokens, against independent references on tiny Qwen3 models with
Qwen3's real vocabulary (tests/support/pooling_models.py): sentence-transformers' embeddings of the
Hugging Face directory (last-token pooling, normalized), from that directory and from its GGUF, and
transformers' logits for a reranker's labels; the same vector whether the prompt runs alone, in
chunks, from a prefix-cache hit or in one mixed step beside a decoding sequence, whose tokens it
leaves as they were; and int8 activations (the default on quantized files) against float32."""

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
from agent.model.formats import load_checkpoint
from agent.model.tokenizer import load_tokenizer
from agent.runner import ModelRunner
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
