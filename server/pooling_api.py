"""The pooling endpoints: OpenAI's POST /v1/embeddings, Jina's and Cohere's rerank (/rerank,
/v1/rerank, /v2/rerank) and vLLM's score (/score, /v1/score), over a model's pooling
(server/pooling.py).

Each input is one engine request of its own: a prompt whose last row returns its vector
(SamplingParams.pool) and which never decodes (one token, not shown). So inputs run in the same
steps as generation, take the prefix cache (a query or instruction shared by many inputs is computed
once), and count in admission and fair share like any other request. A request holds at most
server.max_pooling_inputs inputs and server.max_pooling_tokens tokens in all (400 naming the bound);
an input past the context is refused unless truncate_prompt_tokens cuts it to its last tokens.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import Sequence

import numpy as np
from fastapi import APIRouter, Depends, Request

from server.access import client_of
from server.admission import Admission, Prompt, admit_answers
from server.client_disconnect import unless_disconnected
from server.collect import collected
from server.errors import OPENAI, ApiError, declares
from server.model_repository import LoadedModel, ModelRepository
from server.output import AnswerStream
from server.pooling import cosine, embedding, encoded, relevance
from server.pooling_schema import EmbeddingRequest, PoolingRequest, RerankRequest, ScoreRequest
from server.request_body import json_body


def pooling_model(repository: ModelRepository, req: PoolingRequest, task: str, endpoint: str) -> LoadedModel:
    """The request's model, if it does `task` (embed, score); 400 naming what it does otherwise."""
    model = repository.serving(req.model)
    if task not in model.pooling.tasks:
        raise ApiError(
            400,
            f"model {model.name!r} does not {task} ({endpoint}): it does "
            f"{', '.join(model.pooling.tasks) or 'nothing'} (model.pooling sets how a model pools)",
            param="model",
            code="model_not_supported",
        )
    return model


async def input_ids(model: LoadedModel, req: PoolingRequest, given: str | list[int], param: str) -> list[int]:
    """One input's ids as the model pools them: tokenized (special tokens in the text are read as
    such: a reranker's prompt holds them), cut to truncate_prompt_tokens where asked, its EOS last
    where the model's file says so."""
    cut = req.truncate_prompt_tokens
    if isinstance(given, str):
        ids = await model.encoder.encode(given, bounded=cut is None, param=param)
    else:
        ids = list(given)
    if cut is not None:  # -1: the longest input the model takes (with its EOS)
        keep = longest_input(model) - (model.pooling.eos is not None) if cut == -1 else cut
        ids = ids[-keep:] if keep else []
    ids = model.pooling.ended(ids)
    if not ids:
        raise ApiError(400, f"{param}: an input of no tokens has nothing to pool", param=param)
    return ids


async def all_input_ids(
    model: LoadedModel, req: PoolingRequest, given: Sequence[str | list[int]], param: str
) -> list[list[int]]:
    """Every input's ids (input_ids), tokenized side by side on the encoder's threads; their count
    is bounded first, so a request of a million tiny inputs costs no tokenization."""
    check_input_count(model, len(given), param)
    return list(await asyncio.gather(*(input_ids(model, req, one, param) for one in given)))


def check_input_count(model: LoadedModel, count: int, param: str) -> None:
    most = model.config.server.max_pooling_inputs
    if count > most:
        raise ApiError(
            400, f"{param}: {count} inputs, more than server.max_pooling_inputs ({most})", param=param
        )


def longest_input(model: LoadedModel) -> int:
    """The most tokens one input may have: what the model's agents take as one prompt (the context
    but the one token a pooled prompt samples; an encoder's, what one call computes)."""
    return model.engine.max_prompt_len or model.engine.max_seq_len - 1


async def pooled(
    http: Request, model: LoadedModel, req: PoolingRequest, inputs: Sequence[list[int]], pool, param: str
) -> list[np.ndarray]:
    """Each input's vector (SamplingParams.pool) from the engine, all admitted or none; the bounds
    first: inputs and tokens per request."""
    settings = model.config.server
    check_input_count(model, len(inputs), param)
    longest = longest_input(model)
    for i, ids in enumerate(inputs):
        if len(ids) > longest:
            raise ApiError(
                400,
                f"{param}: input {i} of {len(ids)} tokens exceeds the longest input this model takes "
                f"({longest} tokens): send truncate_prompt_tokens to cut it",
                param=param,
            )
    tokens = sum(len(ids) for ids in inputs)
    if tokens > settings.max_pooling_tokens:
        raise ApiError(
            400,
            f"{param}: {tokens} tokens in all, more than server.max_pooling_tokens "
            f"({settings.max_pooling_tokens})",
            param=param,
        )
    streams: list[AnswerStream] = []
    try:
        for ids in inputs:
            admission = Admission(
                prompt=Prompt(ids=tuple(ids), param=param),
                sampling=req,
                do_sample=False,
                seeds=(None,),
                max_tokens=1,
                max_tokens_param="the pooled token",
                sampling_fields={"pool": pool},
                cache_salt=req.cache_salt,
                client=client_of(http.scope),
                priority=req.priority,
                speculate=False,
            )
            streams += (await admit_answers(model, OPENAI, admission)).streams
    except BaseException:  # the inputs admitted before one was refused go too
        for stream in streams:
            await stream.aclose()
        raise
    result = await unless_disconnected(http, streams, _vectors(streams))
    if not isinstance(result, list):  # the client left: nobody reads the reply
        raise ApiError(499, "the client closed the request")
    return result


async def _vectors(streams: list[AnswerStream]) -> list[np.ndarray]:
    vectors: list[np.ndarray | None] = [None] * len(streams)
    async with contextlib.aclosing(collected(streams)) as outputs:
        async for index, out in outputs:
            if out.finished:
                vectors[index] = out.pooled
    missing = [i for i, v in enumerate(vectors) if v is None]
    if missing:
        raise ApiError(503, f"input {missing[0]} ended without its vector: try again")
    return [v for v in vectors if v is not None]


def usage(inputs: Sequence[list[int]]) -> dict:
    tokens = sum(len(ids) for ids in inputs)
    return {"prompt_tokens": tokens, "total_tokens": tokens}


async def embeddings(http: Request, repository: ModelRepository, req: EmbeddingRequest) -> dict:
    model = pooling_model(repository, req, "embed", "/v1/embeddings")
    hidden = model.pooling.size
    if req.dimensions is not None and req.dimensions != hidden:
        allowed = model.pooling.dimensions
        if allowed is None or req.dimensions not in allowed or req.dimensions > hidden:
            raise ApiError(
                400,
                f"dimensions: {req.dimensions} is not one this model's embeddings may be cut to "
                f"({'its size ' + str(hidden) if allowed is None else ', '.join(map(str, allowed))}; "
                "model.matryoshka_dimensions lists them)",
                param="dimensions",
            )
    inputs = await all_input_ids(model, req, req.inputs(), "input")
    vectors = await pooled(http, model, req, inputs, model.pooling.pool, "input")
    data = [
        {
            "object": "embedding",
            "embedding": encoded(embedding(v, model.pooling, req.dimensions), req.encoding_format),
            "index": i,
        }
        for i, v in enumerate(vectors)
    ]
    return {
        "id": f"embd-{uuid.uuid4().hex}",
        "object": "list",
        "created": int(time.time()),
        "model": model.name,
        "data": data,
        "usage": usage(inputs),
    }


async def pair_scores(
    http: Request, model: LoadedModel, req: PoolingRequest, pairs: list[tuple[str, str]], param: str
) -> tuple[list[float], list[list[int]]]:
    """Each (query, document) pair's score, and the inputs it took: a reranker's relevance of its
    prompt, or an embedder's cosine of the two texts' embeddings (each distinct text embedded once)."""
    if model.pooling.kind == "rank":
        prompts = [model.pooling.rank_prompt(q, d) for q, d in pairs]
        inputs = await all_input_ids(model, req, prompts, param)
        labels = model.pooling.labels
        vectors = await pooled(http, model, req, inputs, labels, param)
        return [relevance(v) for v in vectors], inputs
    texts = list(dict.fromkeys(text for pair in pairs for text in pair))
    inputs = await all_input_ids(model, req, texts, param)
    by_text = dict(zip(texts, await pooled(http, model, req, inputs, model.pooling.pool, param)))
    return [cosine(by_text[q], by_text[d]) for q, d in pairs], inputs


async def rerank(http: Request, repository: ModelRepository, req: RerankRequest, cohere: bool) -> dict:
    model = pooling_model(repository, req, "score", "rerank")
    documents = req.texts()
    scores, inputs = await pair_scores(http, model, req, [(req.query, d) for d in documents], "documents")
    order = sorted(range(len(documents)), key=lambda i: -scores[i])[: req.top_n or len(documents)]
    shown = (not cohere) if req.return_documents is None else req.return_documents
    results = [
        {"index": i, "relevance_score": scores[i], **({"document": {"text": documents[i]}} if shown else {})}
        for i in order
    ]
    reply: dict = {"id": f"rerank-{uuid.uuid4().hex}", "model": model.name, "results": results}
    if cohere:
        reply["meta"] = {
            "billed_units": {"search_units": 1},
            "tokens": {"input_tokens": usage(inputs)["total_tokens"]},
        }
    else:
        reply["usage"] = usage(inputs)
    return reply


async def score(http: Request, repository: ModelRepository, req: ScoreRequest) -> dict:
    model = pooling_model(repository, req, "score", "/score")
    try:
        pairs = req.pairs()
    except ValueError as exc:
        raise ApiError(400, str(exc), param="text_2") from None
    scores, inputs = await pair_scores(http, model, req, pairs, "text_2")
    return {
        "id": f"score-{uuid.uuid4().hex}",
        "object": "list",
        "created": int(time.time()),
        "model": model.name,
        "data": [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)],
        "usage": usage(inputs),
    }


def pooling_router(repository: ModelRepository) -> APIRouter:
    router = APIRouter(dependencies=[declares(OPENAI)])
    embedding_request, rerank_request = json_body(EmbeddingRequest), json_body(RerankRequest)
    score_request = json_body(ScoreRequest)

    @router.post("/v1/embeddings")
    async def create_embeddings(http: Request, req: EmbeddingRequest = Depends(embedding_request)):
        return await embeddings(http, repository, req)

    def reranking(cohere: bool):
        async def reranked(http: Request, req: RerankRequest = Depends(rerank_request)):
            return await rerank(http, repository, req, cohere)

        return reranked

    for path, cohere in (("/rerank", False), ("/v1/rerank", False), ("/v2/rerank", True)):
        router.add_api_route(path, reranking(cohere), methods=["POST"])

    for path in ("/score", "/v1/score"):

        async def scored(http: Request, req: ScoreRequest = Depends(score_request)):
            return await score(http, repository, req)

        router.add_api_route(path, scored, methods=["POST"])
    return router
