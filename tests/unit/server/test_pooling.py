"""A model's pooling read from its file and config (server/pooling.py), and the vector arithmetic
the pooling endpoints share. Files are written here: GGUF headers with the suite's Qwen3
vocabulary (its yes and no tokens) and Hugging Face directories with sentence-transformers'
modules.json."""

import base64
import json

import gguf
import numpy as np
import pytest

import hf_reference as hf
from agent.model.tokenizer import load_tokenizer
from config.model import ModelSection
from server.pooling import (
    RERANK_TEMPLATE,
    Pooling,
    PoolingError,
    embedding,
    encoded,
    model_pooling,
    relevance,
)


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(hf.vocabulary_path("qwen3"))


def gguf_file(path, **keys):
    writer = gguf.GGUFWriter(str(path), "qwen3")
    writer.add_embedding_length(64)
    hf.add_vocabulary(writer, keys)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    return path


def directory(path, mode: dict | None, config: dict | None = None):
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"hidden_size": 32, **(config or {})}))
    if mode is not None:
        modules = [
            {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}
        ]
        (path / "modules.json").write_text(json.dumps(modules))
        (path / "1_Pooling").mkdir()
        (path / "1_Pooling" / "config.json").write_text(json.dumps(mode))
    return path


def test_a_gguf_embedder_pools_its_last_token_and_adds_eos(tmp_path, tokenizer):
    path = gguf_file(
        tmp_path / "e.gguf",
        **{"qwen3.pooling_type": 3, "tokenizer.ggml.add_eos_token": True, "tokenizer.ggml.eos_token_id": 7},
    )
    pooling = model_pooling(ModelSection(path=path), tokenizer)
    assert (pooling.kind, pooling.size, pooling.generates, pooling.eos) == ("last", 64, False, 7)
    assert pooling.tasks == ["embed", "score"]
    assert pooling.ended([1, 2]) == [1, 2, 7] and pooling.ended([1, 7]) == [1, 7]


def test_a_gguf_reranker_reads_its_labels_and_template(tmp_path, tokenizer):
    template = "Q: {query} D: {document}"
    keys = {
        "qwen3.pooling_type": 4,
        "qwen3.classifier.output_labels": ["yes", "no"],
        "tokenizer.chat_template.rerank": template,
    }
    pooling = model_pooling(ModelSection(path=gguf_file(tmp_path / "r.gguf", **keys)), tokenizer)
    assert pooling.kind == "rank" and pooling.tasks == ["score"]
    assert pooling.labels == (tokenizer.tokenizer.token_to_id("yes"), tokenizer.tokenizer.token_to_id("no"))
    assert pooling.rank_prompt("a {x}", "b") == "Q: a {x} D: b"
    plain = gguf_file(tmp_path / "plain.gguf", **{"qwen3.pooling_type": 4})
    assert model_pooling(ModelSection(path=plain), tokenizer).template == RERANK_TEMPLATE


def test_a_generating_model_pools_only_where_its_config_says(tmp_path, tokenizer):
    path = gguf_file(tmp_path / "chat.gguf")
    assert model_pooling(ModelSection(path=path), tokenizer).tasks == ["generate"]
    both = model_pooling(ModelSection(path=path, pooling="last"), tokenizer)
    assert both.tasks == ["generate", "embed", "score"]
    embedder = gguf_file(tmp_path / "e.gguf", **{"qwen3.pooling_type": 3})
    assert model_pooling(ModelSection(path=embedder, pooling="none"), tokenizer).tasks == ["generate"]


def test_a_directory_says_its_pooling_in_modules_json(tmp_path, tokenizer):
    last = directory(
        tmp_path / "last", {"pooling_mode_lasttoken": True}, {"matryoshka_dimensions": [8, 16, 32]}
    )
    pooling = model_pooling(ModelSection(path=last), tokenizer)
    assert (pooling.kind, pooling.size, pooling.generates, pooling.dimensions) == (
        "last",
        32,
        False,
        (8, 16, 32),
    )
    assert model_pooling(ModelSection(path=last, matryoshka_dimensions=[16]), tokenizer).dimensions == (16,)
    newer = directory(tmp_path / "newer", {"pooling_mode": "lasttoken"})
    assert model_pooling(ModelSection(path=newer), tokenizer).kind == "last"
    assert model_pooling(ModelSection(path=directory(tmp_path / "none", None)), tokenizer).kind == "none"


@pytest.mark.parametrize(
    ("mode", "kind"),
    [({"pooling_mode_mean_tokens": True}, "mean"), ({"pooling_mode_cls_token": True}, "cls")],
)
def test_mean_and_cls_pool_an_encoder_and_are_refused_on_a_decoder(tmp_path, tokenizer, mode, kind):
    """An encoder (use_bidirectional_attention: EmbeddingGemma's config) pools every token or the
    first; a decoder's inputs may be chunked, so the same modes are refused saying what to set."""
    encoder = directory(tmp_path / "enc", mode, {"use_bidirectional_attention": True})
    pooling = model_pooling(ModelSection(path=encoder), tokenizer)
    assert (pooling.kind, pooling.pool, pooling.tasks) == (kind, kind, ["embed", "score"])
    with pytest.raises(PoolingError, match="set model.pooling to last, or none"):
        model_pooling(ModelSection(path=directory(tmp_path / "dec", mode)), tokenizer)
    chat = gguf_file(tmp_path / "chat.gguf")
    with pytest.raises(PoolingError, match="only an encoder's"):
        model_pooling(ModelSection(path=chat, pooling=kind), tokenizer)


def test_an_encoder_only_pools_whatever_its_config_says(tmp_path, tokenizer):
    """An encoder's graphs run no LM head: it never generates (even given a pooling in its config,
    which makes a decoder do both), and generation or rank pooling is refused at start."""
    encoder = directory(
        tmp_path / "enc", {"pooling_mode_mean_tokens": True}, {"use_bidirectional_attention": True}
    )
    for kind in ("mean", "last"):
        assert not model_pooling(ModelSection(path=encoder, pooling=kind), tokenizer).generates
    for kind, refused in (("none", "cannot generate"), ("rank", "cannot rank")):
        with pytest.raises(PoolingError, match=f"{refused}.*set model.pooling to mean, cls or last"):
            model_pooling(ModelSection(path=encoder, pooling=kind), tokenizer)


def test_a_directory_s_dense_modules_size_its_embeddings(tmp_path, tokenizer):
    path = directory(tmp_path / "dense", {"pooling_mode": "mean"}, {"use_bidirectional_attention": True})
    modules = json.loads((path / "modules.json").read_text())
    modules.append({"idx": 2, "name": "2", "path": "2_Dense", "type": "sentence_transformers.models.Dense"})
    (path / "modules.json").write_text(json.dumps(modules))
    (path / "2_Dense").mkdir()
    (path / "2_Dense" / "config.json").write_text(json.dumps({"in_features": 32, "out_features": 24}))
    assert model_pooling(ModelSection(path=path), tokenizer).size == 24


def test_a_reranker_without_its_label_tokens_is_refused(tmp_path):
    tiny = load_tokenizer(hf.vocabulary_path("llama3"))
    keys = {"qwen3.pooling_type": 4, "qwen3.classifier.output_labels": ["zzqq-yes", "zzqq-no"]}
    with pytest.raises(PoolingError, match="label tokens"):
        model_pooling(ModelSection(path=gguf_file(tmp_path / "r.gguf", **keys)), tiny)


def test_the_vector_arithmetic():
    hidden = np.array([3.0, 4.0, 12.0], np.float32)
    normalized = Pooling("last", 3)
    np.testing.assert_allclose(embedding(hidden, normalized, None), hidden / 13)
    np.testing.assert_allclose(embedding(hidden, normalized, 2), [0.6, 0.8])  # cut, then normalized
    np.testing.assert_allclose(embedding(hidden, Pooling("last", 3, normalize=False), 2), [3, 4])
    packed = encoded(np.array([0.25, -1.5]), "base64")
    assert np.frombuffer(base64.b64decode(packed), "<f4").tolist() == [0.25, -1.5]
    assert encoded(np.array([0.25, -1.5]), "float") == [0.25, -1.5]
    assert relevance(np.array([2.0, 2.0])) == 0.5
    assert abs(relevance(np.array([3.0, 1.0])) - 1 / (1 + np.exp(-2))) < 1e-12
