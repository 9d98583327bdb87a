"""The pooling endpoints over HTTP (`start_agent.py`, `start_server.py`, real ZeroMQ and uvicorn):
one server with a chat model that also embeds (model.pooling last), an embedder GGUF as
Qwen3-Embedding's is written (pooling_type 3, EOS added to each input) and a reranker GGUF as
Qwen3-Reranker's (pooling_type 4), tiny Qwen3 models with Qwen3's real vocabulary, and an encoder
GGUF as EmbeddingGemma's is written (bidirectional, mean pooling, dense projections;
tests/support/pooling_models.py).

References: sentence-transformers over the embedder's Hugging Face directory (embeddings, and its
cosines as /score's), transformers' logits for the reranker's labels (relevance = P(yes)). Clients:
OpenAI's SDK (float and base64), LangChain's OpenAIEmbeddings, Cohere's and Jina's rerank shapes.
Every bound and bad request gets its status and a message naming it; a chat model's answers and
embeddings are the same with both kinds of request in flight together."""

import base64
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pytest
import torch
import yaml

import pooling_models
from agent.model.tokenizer import load_tokenizer
from agent_harness import LONG_ANSWERS_RUNTIME, free_ports, serving_stack
from server.pooling import RERANK_TEMPLATE

COSINE = 0.99999
SCORE_TOLERANCE = 1e-3
MAX_INPUTS, MAX_TOKENS = 8, 600
EOS = "<|endoftext|>"  # the embedder's EOS, which its GGUF adds to every input
DOCUMENTS = [
    "Paris is the capital and largest city of France.",
    "Bananas are an excellent source of potassium.",
    "The Eiffel Tower stands in Paris.",
    "Photosynthesis turns light into chemical energy.",
]
QUERY = "What is the capital of France?"


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    embedder = pooling_models.write_embedder(tmp_path_factory.mktemp("embedder"))
    reranker = pooling_models.write_reranker(tmp_path_factory.mktemp("reranker"))
    encoder = pooling_models.write_gemma_embedder(tmp_path_factory.mktemp("encoder"))
    return embedder, reranker, encoder


@pytest.fixture(scope="module")
def base(tmp_path_factory, tiny_llama_dir, models):
    (_, embedder, _), (reranker, _), (_, encoder, _) = models
    directory = tmp_path_factory.mktemp("pooling-stack")
    http, chat_port, embed_port, rank_port, encoder_port = free_ports(5)
    runtime = {**LONG_ANSWERS_RUNTIME, "memory_budget_mb": 64}
    config = {
        "agents": {"startup_timeout_s": 180, "shutdown_grace_s": 5},
        "logging": {"dir": str(directory / "logs")},
        "server": {"port": http, "max_pooling_inputs": MAX_INPUTS, "max_pooling_tokens": MAX_TOKENS},
        "models": [
            {
                "name": "chat",
                "path": str(tiny_llama_dir),
                "pooling": "last",
                "runtime": runtime,
                "agents": {"ports": [chat_port]},
            },
            {
                "name": "embedder",
                "path": str(embedder),
                "runtime": runtime,
                "agents": {"ports": [embed_port]},
            },
            {"name": "reranker", "path": str(reranker), "runtime": runtime, "agents": {"ports": [rank_port]}},
            {
                "name": "encoder",
                "path": str(encoder),
                "runtime": runtime,
                "agents": {"ports": [encoder_port]},
            },
        ],
    }
    path = directory / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    with serving_stack(path):
        yield f"http://127.0.0.1:{http}"


@pytest.fixture(scope="module")
def reference(models):
    from sentence_transformers import SentenceTransformer

    (directory, _, _), _, _ = models
    return SentenceTransformer(str(directory), device="cpu")


def post(base: str, path: str, body: dict, status: int = 200) -> dict:
    reply = httpx.post(f"{base}{path}", json=body, timeout=120)
    assert reply.status_code == status, reply.text
    return reply.json()


def cosine(a, b) -> float:
    a, b = np.asarray(a), np.asarray(b)
    return float(np.dot(a, b) / (np.linalg.norm(a) * np.linalg.norm(b)))


def test_models_say_what_each_does(base):
    listed = {m["id"]: m["tasks"] for m in httpx.get(f"{base}/v1/models").json()["data"]}
    assert listed == {
        "chat": ["generate", "embed", "score"],
        "embedder": ["embed", "score"],
        "reranker": ["score"],
        "encoder": ["embed", "score"],
    }
    for name, tasks in listed.items():
        assert httpx.get(f"{base}/tokenizer_info", params={"model": name}).json()["tasks"] == tasks


def test_embeddings_equal_sentence_transformers(base, reference):
    reply = post(base, "/v1/embeddings", {"model": "embedder", "input": DOCUMENTS})
    want = reference.encode([d + EOS for d in DOCUMENTS], convert_to_numpy=True, batch_size=1)
    assert reply["object"] == "list" and reply["model"] == "embedder"
    assert [d["index"] for d in reply["data"]] == [0, 1, 2, 3]
    for item, vector in zip(reply["data"], want):
        assert item["object"] == "embedding" and len(item["embedding"]) == 64
        assert cosine(item["embedding"], vector) >= COSINE
        assert abs(np.linalg.norm(item["embedding"]) - 1) < 1e-6
    ids = [reference.preprocess([d + EOS])["input_ids"][0].tolist() for d in DOCUMENTS]
    assert reply["usage"] == {"prompt_tokens": sum(map(len, ids)), "total_tokens": sum(map(len, ids))}
    # token ids as they are (EOS added where they lack it), base64 the same float32 values
    by_ids = post(base, "/v1/embeddings", {"model": "embedder", "input": [i[:-1] for i in ids]})
    encoded = post(
        base, "/v1/embeddings", {"model": "embedder", "input": DOCUMENTS, "encoding_format": "base64"}
    )
    for plain, again, packed in zip(reply["data"], by_ids["data"], encoded["data"]):
        np.testing.assert_allclose(again["embedding"], plain["embedding"], atol=1e-6)
        decoded = np.frombuffer(base64.b64decode(packed["embedding"]), "<f4")
        np.testing.assert_allclose(decoded, np.float32(plain["embedding"]), atol=1e-6)
    one = post(base, "/v1/embeddings", {"model": "embedder", "input": DOCUMENTS[0]})
    np.testing.assert_allclose(one["data"][0]["embedding"], reply["data"][0]["embedding"], atol=1e-6)


def test_openai_and_langchain_clients(base, reference):
    from langchain_openai import OpenAIEmbeddings
    from openai import OpenAI

    want = reference.encode([d + EOS for d in DOCUMENTS], convert_to_numpy=True, batch_size=1)
    client = OpenAI(base_url=f"{base}/v1", api_key="unused")
    floats = client.embeddings.create(model="embedder", input=DOCUMENTS, encoding_format="float")
    assert all(cosine(d.embedding, w) >= COSINE for d, w in zip(floats.data, want))
    packed = client.embeddings.create(model="embedder", input=DOCUMENTS, encoding_format="base64")
    decoded = [np.frombuffer(base64.b64decode(d.embedding), "<f4") for d in packed.data]  # given as sent
    assert all(cosine(v, w) >= COSINE for v, w in zip(decoded, want))
    default = client.embeddings.create(model="embedder", input=DOCUMENTS[:1])  # asked base64, decoded
    assert cosine(default.data[0].embedding, want[0]) >= COSINE
    # LangChain tokenizes with tiktoken unless told not to: an OpenAI-compatible server's setting
    lang = OpenAIEmbeddings(
        model="embedder", base_url=f"{base}/v1", api_key="unused", check_embedding_ctx_length=False
    )
    assert all(cosine(v, w) >= COSINE for v, w in zip(lang.embed_documents(DOCUMENTS), want))
    assert cosine(lang.embed_query(DOCUMENTS[2]), want[2]) >= COSINE


def relevance_of(models, documents: list[str]) -> list[float]:
    """transformers' P(yes) of the reranker's prompt for each document."""
    _, (gguf, model), _ = models
    tokenizer = load_tokenizer(gguf)
    yes, no = (tokenizer.tokenizer.token_to_id(t) for t in ("yes", "no"))
    scores = []
    for document in documents:
        text = RERANK_TEMPLATE.replace("{query}", QUERY).replace("{document}", document)
        with torch.no_grad():
            logits = model(torch.tensor([tokenizer.encode(text, add_special_tokens=False)])).logits[0, -1]
        scores.append(float(torch.softmax(logits[[yes, no]], -1)[0]))
    return scores


def test_rerank_orders_by_the_rerankers_relevance(base, models):
    want = relevance_of(models, DOCUMENTS)
    order = sorted(range(len(DOCUMENTS)), key=lambda i: -want[i])
    given = [DOCUMENTS[0], {"text": DOCUMENTS[1]}, *DOCUMENTS[2:]]
    for path in ("/rerank", "/v1/rerank"):
        reply = post(base, path, {"model": "reranker", "query": QUERY, "documents": given, "top_n": 3})
        assert [r["index"] for r in reply["results"]] == order[:3]
        for result in reply["results"]:
            assert abs(result["relevance_score"] - want[result["index"]]) < SCORE_TOLERANCE
            assert result["document"] == {"text": DOCUMENTS[result["index"]]}
        assert reply["usage"]["total_tokens"] > 0
    cohere = post(base, "/v2/rerank", {"model": "reranker", "query": QUERY, "documents": DOCUMENTS})
    assert [r["index"] for r in cohere["results"]] == order
    assert all("document" not in r for r in cohere["results"]) and cohere["meta"]["billed_units"]
    scored = post(base, "/score", {"model": "reranker", "text_1": QUERY, "text_2": DOCUMENTS})
    assert [abs(d["score"] - w) < SCORE_TOLERANCE for d, w in zip(scored["data"], want)] == [True] * 4


def test_an_encoders_embeddings_equal_sentence_transformers(base, models):
    """EmbeddingGemma's shape served from its GGUF: each input whole (the longest the largest prefill
    bucket, 64 tokens here), every token attending every other, mean-pooled and projected; an input
    past that is refused naming the bound, and truncate_prompt_tokens -1 keeps what fits."""
    _, _, (_, _, reference) = models
    texts = [*DOCUMENTS, "The quick brown fox jumps over the lazy dog and keeps running far away."]
    reply = post(base, "/v1/embeddings", {"model": "encoder", "input": texts})
    want = reference.encode(texts, convert_to_numpy=True, batch_size=1)
    for item, vector in zip(reply["data"], want):
        assert len(item["embedding"]) == 64 and cosine(item["embedding"], vector) >= COSINE
    longest = LONG_ANSWERS_RUNTIME["prefill_buckets"][-1]
    refused = httpx.post(
        f"{base}/v1/embeddings", json={"model": "encoder", "input": "word " * 80}, timeout=60
    )
    assert refused.status_code == 400 and f"longest input this model takes ({longest} tokens)" in refused.text
    cut = post(
        base, "/v1/embeddings", {"model": "encoder", "input": "word " * 80, "truncate_prompt_tokens": -1}
    )
    assert cut["usage"]["prompt_tokens"] == longest
    scored = post(base, "/score", {"model": "encoder", "text_1": texts[0], "text_2": texts[1:]})
    assert all(abs(d["score"] - cosine(want[0], w)) < 1e-5 for d, w in zip(scored["data"], want[1:]))


def test_an_embedders_scores_are_its_cosines(base, reference):
    vectors = reference.encode([t + EOS for t in [QUERY, *DOCUMENTS]], convert_to_numpy=True, batch_size=1)
    want = [cosine(vectors[0], v) for v in vectors[1:]]
    for path in ("/score", "/v1/score"):
        reply = post(base, path, {"model": "embedder", "text_1": QUERY, "text_2": DOCUMENTS})
        assert [d["index"] for d in reply["data"]] == [0, 1, 2, 3] and reply["object"] == "list"
        assert all(abs(d["score"] - w) < 1e-5 for d, w in zip(reply["data"], want))
    pairs = post(base, "/score", {"model": "embedder", "text_1": [QUERY, QUERY], "text_2": DOCUMENTS[:2]})
    assert [round(d["score"], 5) for d in pairs["data"]] == [round(w, 5) for w in want[:2]]
    reranked = post(base, "/v1/rerank", {"model": "embedder", "query": QUERY, "documents": DOCUMENTS})
    assert [r["index"] for r in reranked["results"]] == sorted(range(4), key=lambda i: -want[i])


@pytest.mark.parametrize(
    ("path", "body", "status", "names"),
    [
        ("/v1/embeddings", {"model": "reranker", "input": "x"}, 400, "does not embed"),
        ("/v1/rerank", {"model": "nobody", "query": "q", "documents": ["d"]}, 404, "not served"),
        (
            "/v1/chat/completions",
            {"model": "embedder", "messages": [{"role": "user", "content": "hi"}]},
            400,
            "pooling model",
        ),
        (
            "/v1/embeddings",
            {"model": "embedder", "input": ["a"] * (MAX_INPUTS + 1)},
            400,
            "max_pooling_inputs",
        ),
        ("/v1/embeddings", {"model": "embedder", "input": ["word " * 150] * 4}, 400, "max_pooling_tokens"),
        ("/v1/embeddings", {"model": "embedder", "input": "word " * 600}, 400, "longest input"),
        ("/v1/embeddings", {"model": "embedder", "input": [[1, 2, 10**7]]}, 400, "outside the vocabulary"),
        ("/v1/embeddings", {"model": "embedder", "input": "x", "dimensions": 32}, 400, "dimensions"),
        (
            "/v1/embeddings",
            {"model": "embedder", "input": "x", "encoding_format": "int8"},
            400,
            "encoding_format",
        ),
        ("/v1/embeddings", {"model": "embedder", "input": []}, 400, "input"),
        ("/v1/embeddings", {"model": "embedder"}, 400, "input"),
        ("/v1/rerank", {"model": "reranker", "query": "q", "documents": []}, 400, "documents"),
        ("/v1/rerank", {"model": "reranker", "query": "q", "documents": ["d"], "top_n": 0}, 400, "top_n"),
        ("/score", {"model": "embedder", "text_1": ["a", "b"], "text_2": ["c", "d", "e"]}, 400, "text_1"),
    ],
)
def test_bad_requests_and_bounds_are_refused_naming_them(base, path, body, status, names):
    reply = httpx.post(f"{base}{path}", json=body, timeout=60)
    assert reply.status_code == status, reply.text
    assert names in reply.text


def test_truncate_prompt_tokens_keeps_an_inputs_last_tokens(base):
    long = "word " * 600
    cut = post(base, "/v1/embeddings", {"model": "embedder", "input": long, "truncate_prompt_tokens": 100})
    assert cut["usage"]["prompt_tokens"] == 101  # its last 100 tokens and EOS
    whole = post(base, "/v1/embeddings", {"model": "embedder", "input": long, "truncate_prompt_tokens": -1})
    assert whole["usage"]["prompt_tokens"] == LONG_ANSWERS_RUNTIME["max_seq_len"] - 1  # and its one token


def test_chat_and_embeddings_in_flight_together_give_what_each_gives_alone(base):
    chat = {"model": "chat", "prompt": "Once upon a time", "max_tokens": 24}
    texts = [f"Document number {i} is about {w}." for i, w in enumerate(["cats", "tea", "rain", "maps"])]

    def answer(_):
        return post(base, "/v1/completions", {**chat, "temperature": 0})["choices"][0]["text"]

    def embed(text):
        return post(base, "/v1/embeddings", {"model": "chat", "input": text})["data"][0]["embedding"]

    alone_answer, alone = answer(0), [embed(t) for t in texts]
    with ThreadPoolExecutor(8) as pool:
        answers = pool.map(answer, range(4))
        vectors = pool.map(embed, texts)
        answers, vectors = list(answers), list(vectors)
    assert answers == [alone_answer] * 4
    for got, want in zip(vectors, alone):
        np.testing.assert_allclose(got, want, atol=1e-5)
