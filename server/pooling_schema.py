"""Request bodies of the pooling endpoints (server/pooling_api.py): OpenAI's embeddings, Jina's and
Cohere's rerank (vLLM serves both shapes), vLLM's score. Unknown fields are accepted, as the other
APIs' bodies (SDKs send more than they need); every size is bounded here or at admission
(server.max_pooling_inputs, server.max_pooling_tokens)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, Field, StringConstraints, field_validator

from agent.contract.sampling import MAX_PRIORITY, CacheSalt

MAX_INPUT_IDS = 1 << 20  # token ids in one input (an input past the context is refused anyway)
TokenIds = Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1, max_length=MAX_INPUT_IDS)]
# One input may be empty text: it is its special tokens alone, as OpenAI's and vLLM's
Text = Annotated[str, StringConstraints(max_length=1 << 24)]


class PoolingRequest(BaseModel):
    """What every pooling body may name beside its inputs."""

    model: str | None = None
    # vLLM's: each input cut to its last k tokens (-1: to the context), instead of refused
    truncate_prompt_tokens: int | None = Field(None, ge=-1)
    cache_salt: CacheSalt | None = None
    priority: int = Field(0, ge=-MAX_PRIORITY, le=MAX_PRIORITY)
    user: str | None = Field(None, max_length=256)


class EmbeddingRequest(PoolingRequest):
    """OpenAI's /v1/embeddings: a text, texts, token ids or lists of them."""

    input: Text | list[Text] | TokenIds | list[TokenIds]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1)

    @field_validator("input")
    @classmethod
    def _some(cls, given):
        if isinstance(given, list) and not given:
            raise ValueError("input holds at least one text or list of token ids")
        return given

    def inputs(self) -> list[str | list[int]]:
        given = self.input
        if isinstance(given, str):
            return [given]
        if given and all(isinstance(item, int) for item in given):
            return [given]  # type: ignore[list-item]
        return list(given)  # type: ignore[arg-type]


class DocumentText(BaseModel):
    text: Text


class RerankRequest(PoolingRequest):
    """Jina's and Cohere's rerank (/rerank, /v1/rerank, /v2/rerank): documents by relevance."""

    query: Text
    documents: list[Text | DocumentText] = Field(min_length=1)
    top_n: int | None = Field(None, ge=1)
    return_documents: bool | None = None  # None: the API's default (Jina: true, Cohere v2: false)

    def texts(self) -> list[str]:
        return [d if isinstance(d, str) else d.text for d in self.documents]


class ScoreRequest(PoolingRequest):
    """vLLM's /score: text_1 against each text_2 (one to many), or pairwise (lists of one length)."""

    text_1: Text | list[Text]
    text_2: Text | list[Text]

    def pairs(self) -> list[tuple[str, str]]:
        """(text_1, text_2) per score; ValueError where the lists do not pair."""
        first = [self.text_1] if isinstance(self.text_1, str) else self.text_1
        second = [self.text_2] if isinstance(self.text_2, str) else self.text_2
        if not first or not second:
            raise ValueError("text_1 and text_2 each hold at least one text")
        if len(first) == 1:
            return [(first[0], text) for text in second]
        if len(first) != len(second):
            raise ValueError(
                f"text_1 holds {len(first)} texts and text_2 {len(second)}: send one text_1, or as "
                "many as text_2"
            )
        return list(zip(first, second))
