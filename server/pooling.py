"""A model's pooling: what its embeddings and relevance scores are (config model.pooling, else what
its file says), and the vector arithmetic the pooling endpoints share (server/pooling_api.py).

Decoder models pool their prompt's last token, encoders every token (the agent returns the pooled
vector, SamplingParams.pool):

- `last` (Qwen3-Embedding, gte-Qwen2, e5-mistral): the last token's final hidden state (after the
  final norm) is the embedding, scaled to length 1 (pooling_normalize). Two texts' score is their
  embeddings' cosine (vLLM's score API for embedding models).
- `rank` (Qwen3-Reranker): a query and a document written into the reranker's prompt; the score is
  P(yes) over the two label tokens' logits at its last token, sigmoid(yes - no), as the model card
  computes it and llama.cpp's rank pooling does.
- `mean` and `cls` (EmbeddingGemma; encoders only, whose prompts run whole: ModelSpec.bidirectional):
  the mean of every token's final hidden state, or the first token's, through the model's dense
  projections (sentence-transformers' Dense modules, in the GGUF as dense_2 and dense_3), then
  normalized as `last`.

A GGUF says which by `{arch}.pooling_type` (llama.cpp's enum: 0 none, 1 mean, 2 cls, 3 last, 4
rank), its label tokens by `{arch}.classifier.output_labels`, the reranker's prompt by its `rerank`
chat template and whether an input ends with EOS by `tokenizer.ggml.add_eos_token`; a Hugging Face
directory by sentence-transformers' modules.json (its Pooling module's config) and its config's
`matryoshka_dimensions`. A file that declares its pooling is an embedding or reranking model and
serves only those; a model given `pooling` in its config keeps generating too.
"""

from __future__ import annotations

import base64
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from agent.model.families import GGUF
from agent.model.formats.gguf_file import gguf_field, read_gguf
from agent.model.tokenizer import TextTokenizer
from config.model import ModelSection

GGUF_POOLING = {0: "none", 1: "mean", 2: "cls", 3: "last", 4: "rank"}  # llama.cpp's llama_pooling_type
# Qwen3-Reranker's prompt (its model card's, which llama.cpp's converter writes as the `rerank`
# template): a reranker file without a template of its own is read with it.
RERANK_TEMPLATE = (
    "<|im_start|>system\nJudge whether the Document meets the requirements based on the Query and the "
    'Instruct provided. Note that the answer can only be "yes" or "no".<|im_end|>\n'
    "<|im_start|>user\n<Instruct>: Given a web search query, retrieve relevant passages that answer "
    "the query\n<Query>: {query}\n<Document>: {document}<|im_end|>\n"
    "<|im_start|>assistant\n<think>\n\n</think>\n\n"
)
RANK_LABELS = ("yes", "no")  # the relevant label first, as llama.cpp's classifier labels


class PoolingError(ValueError):
    """A model whose pooling cannot be served; the message says why and what to set."""


@dataclass(frozen=True)
class Pooling:
    kind: str  # none, last, mean, cls or rank
    size: int  # an embedding's: the model's hidden size, or its last projection's
    normalize: bool = True
    generates: bool = True  # it serves text generation too (its file does not declare a pooling)
    dimensions: tuple[int, ...] | None = None  # the Matryoshka sizes an embedding may be cut to
    eos: int | None = None  # the id each input ends with (the file's add_eos_token), if any
    labels: tuple[int, int] | None = None  # rank: the ids of the relevant and irrelevant labels
    template: str = RERANK_TEMPLATE  # rank: the prompt, with {query} and {document}

    @property
    def tasks(self) -> list[str]:
        """What the model does, as /v1/models says it: generate, embed, score."""
        tasks = ["generate"] if self.generates else []
        return tasks + (
            [] if self.kind == "none" else ["score"] if self.kind == "rank" else ["embed", "score"]
        )

    @property
    def pool(self) -> str:
        """What the agent returns of an input for an embedding (SamplingParams.pool)."""
        return {"last": "hidden"}.get(self.kind, self.kind)

    def ended(self, ids: list[int]) -> list[int]:
        """An input's ids as the model pools them: with its EOS last where the file says so."""
        return ids + [self.eos] if self.eos is not None and (not ids or ids[-1] != self.eos) else ids

    def rank_prompt(self, query: str, document: str) -> str:
        # replace, not format: a query or document holding braces stays as it is
        return self.template.replace("{query}", query).replace("{document}", document)


def model_pooling(settings: ModelSection, tokenizer: TextTokenizer) -> Pooling:
    """The model's pooling: its config's, else its file's (PoolingError where it cannot be served)."""
    found = _file_pooling(settings.path)
    kind = found.get("kind", "none") if settings.pooling == "auto" else settings.pooling
    if kind in ("mean", "cls") and not found.get("encoder"):
        raise PoolingError(
            f"{settings.path}: {kind} pooling needs every token of an input in one step, which only "
            "an encoder's inputs run in (a decoder's are chunked and reuse cached prefixes); set "
            "model.pooling to last, or none"
        )
    if found.get("encoder") and kind in ("none", "rank"):
        raise PoolingError(
            f"{settings.path}: an encoder computes no logits (its attention reads the whole input: it "
            "cannot continue a text, and its graphs run no LM head), so it cannot "
            + ("generate" if kind == "none" else "rank by label tokens")
            + "; set model.pooling to mean, cls or last"
        )
    labels = None
    if kind == "rank":
        names = found.get("labels") or RANK_LABELS
        ids = [tokenizer.tokenizer.token_to_id(name) for name in names[:2]]
        if len(ids) != 2 or ids[0] is None or ids[1] is None:
            raise PoolingError(
                f"{settings.path}: rank pooling needs the label tokens {names[:2]} in the vocabulary"
            )
        labels = (ids[0], ids[1])
    dimensions = settings.matryoshka_dimensions or found.get("dimensions")
    return Pooling(
        kind,
        found["size"],
        settings.pooling_normalize,
        generates=not found.get("encoder") and (not found.get("kind") or settings.pooling != "auto"),
        dimensions=None if dimensions is None else tuple(dimensions),
        eos=found.get("eos"),
        labels=labels,
        template=found.get("template") or RERANK_TEMPLATE,
    )


def _file_pooling(path: Path) -> dict:
    """What the model's file says of its pooling: size (its hidden size, or its last projection's),
    kind (only where it declares one), labels, template, eos, dimensions, encoder (its attention is
    bidirectional)."""
    if path.is_file() and path.suffix == ".gguf":
        reader = read_gguf(path)
        arch = gguf_field(reader, "general.architecture", "")
        size = gguf_field(reader, f"{arch}.dense_3_feat_out") or gguf_field(
            reader, f"{arch}.embedding_length", 0
        )
        layout = GGUF.get(str(arch))
        found: dict = {"size": int(size), "encoder": layout is not None and layout.encoder}
        kind = GGUF_POOLING.get(int(gguf_field(reader, f"{arch}.pooling_type", 0)), "none")
        if kind != "none":
            found["kind"] = kind
        labels = gguf_field(reader, f"{arch}.classifier.output_labels")
        if labels:
            found["labels"] = tuple(str(label) for label in labels)
        template = gguf_field(reader, "tokenizer.chat_template.rerank")
        if template:
            found["template"] = str(template)
        eos = gguf_field(reader, "tokenizer.ggml.eos_token_id")
        if gguf_field(reader, "tokenizer.ggml.add_eos_token", False) and eos is not None:
            found["eos"] = int(eos)
        return found
    return _directory_pooling(path if path.is_dir() else path.parent)


def _directory_pooling(directory: Path) -> dict:
    """sentence-transformers' modules.json: the Pooling module's mode, the last Dense module's size;
    the config's Matryoshka sizes and whether it is an encoder (use_bidirectional_attention)."""
    config = _json(directory / "config.json")
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    found: dict = {
        "size": int(text.get("hidden_size", 0)),
        "encoder": bool(text.get("use_bidirectional_attention")),
    }
    if isinstance(config.get("matryoshka_dimensions"), list):
        found["dimensions"] = [int(d) for d in config["matryoshka_dimensions"]]
    modules = _json(directory / "modules.json", [])
    for module in modules if isinstance(modules, list) else []:
        if isinstance(module, dict) and str(module.get("type", "")).endswith("Dense"):
            found["size"] = int(
                _json(directory / str(module.get("path", "")) / "config.json").get("out_features", 0)
            )
        if isinstance(module, dict) and str(module.get("type", "")).endswith("Pooling"):
            mode = _json(directory / str(module.get("path", "")) / "config.json")
            for key, kind in (
                ("pooling_mode_lasttoken", "last"),
                ("pooling_mode_mean_tokens", "mean"),
                ("pooling_mode_cls_token", "cls"),
            ):
                if mode.get(key):
                    found["kind"] = kind
                    break
            else:
                if mode.get("pooling_mode") in ("lasttoken", "mean", "cls"):
                    found["kind"] = {"lasttoken": "last"}.get(mode["pooling_mode"], mode["pooling_mode"])
    return found


def _json(path: Path, default=None):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {} if default is None else default


# ------------------------------------------------------------------------------- vector arithmetic


def embedding(hidden: np.ndarray, pooling: Pooling, dimensions: int | None) -> np.ndarray:
    """A pooled hidden state as the API returns it: cut to `dimensions` (Matryoshka), then scaled to
    length 1 where the model normalizes (float64: what JSON's floats carry)."""
    vector = hidden.astype(np.float64)[: dimensions or len(hidden)]
    if pooling.normalize:
        norm = np.linalg.norm(vector)
        vector = vector / norm if norm > 0 else vector
    return vector


def encoded(vector: np.ndarray, encoding_format: str) -> list[float] | str:
    """OpenAI's two encodings: a list of floats, or base64 of its little-endian float32 bytes."""
    if encoding_format == "base64":
        return base64.b64encode(vector.astype("<f4").tobytes()).decode("ascii")
    return vector.tolist()


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    norms = float(np.linalg.norm(a) * np.linalg.norm(b))
    return float(np.dot(a, b) / norms) if norms > 0 else 0.0


def relevance(label_logits: np.ndarray) -> float:
    """A reranker's score from its (relevant, irrelevant) label logits: P(relevant) of the two."""
    return float(1.0 / (1.0 + np.exp(float(label_logits[1]) - float(label_logits[0]))))
