"""vLLM's tokenizer endpoints, for clients that count or build prompts in tokens (lm-evaluation-
harness's `tokenizer_backend=remote` among them):

    POST /tokenize        {["model",] "prompt"[, "add_special_tokens"]} or {["model",] "messages"}
                          -> {"tokens": [...], "count", "max_model_len"}
    POST /detokenize      {["model",] "tokens"} -> {"prompt"}
    GET  /tokenizer_info  [?model=] -> {"bos_token", "eos_token", "pad_token", "chat_template",
                          "model_max_length", "tokenizer_class", "tasks" (generate, embed,
                          score: server/pooling.py)}

Without a model, the first configured one answers (as vLLM's one model does). Text is bounded as
prompts are (413 past the longest prompt); token lists by the context.
"""

from __future__ import annotations

from fastapi import APIRouter, Depends, Query
from pydantic import BaseModel, ConfigDict, Field

from server.admission import check_vocabulary
from server.errors import OPENAI, ApiError, declares
from server.model_repository import ModelRepository
from server.openai_schema import MAX_MESSAGES, ChatMessage, refused_content
from server.request_body import json_body


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1, max_length=MAX_MESSAGES)
    add_special_tokens: bool = True  # prompt: what the tokenizer adds around plain text (BOS)


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    tokens: list[int]


def tokenize_router(repository: ModelRepository) -> APIRouter:
    router = APIRouter(dependencies=[declares(OPENAI)])  # vLLM answers these in OpenAI's shape
    tokenize_request, detokenize_request = json_body(TokenizeRequest), json_body(DetokenizeRequest)

    @router.post("/tokenize")
    async def tokenize(req: TokenizeRequest = Depends(tokenize_request)):
        model = repository.serving(req.model)
        encoder, engine = model.encoder, model.engine
        if (req.prompt is None) == (req.messages is None):
            raise ApiError(400, "send either prompt or messages", param="prompt")
        if req.messages is not None:
            problem = refused_content(req.messages)
            if problem:
                raise ApiError(400, problem, param="messages")
            messages = [{"role": m.role, "content": m.text()} for m in req.messages]
            tokens = await encoder.encode_chat(messages, param="messages")
        else:
            assert req.prompt is not None
            tokens = await encoder.encode(
                req.prompt, param="prompt", add_special_tokens=req.add_special_tokens
            )
        return {"tokens": tokens, "count": len(tokens), "max_model_len": engine.max_seq_len}

    @router.post("/detokenize")
    async def detokenize(req: DetokenizeRequest = Depends(detokenize_request)):
        model = repository.serving(req.model)
        tokenizer, context = model.tokenizer, model.engine.max_seq_len
        if len(req.tokens) > context:
            raise ApiError(
                400, f"at most {context} tokens (the context), got {len(req.tokens)}", param="tokens"
            )
        check_vocabulary(req.tokens, tokenizer.vocab_size, "tokens")
        return {"prompt": tokenizer.decode(req.tokens, skip_special_tokens=False)}

    @router.get("/tokenizer_info")
    async def tokenizer_info(model: str | None = Query(None, max_length=256)):
        loaded = repository.serving(model)
        tokenizer = loaded.tokenizer
        return {
            "tokenizer_class": "PreTrainedTokenizerFast",  # a tokenizer.json's (tokenizers) class
            "bos_token": tokenizer.bos_token,
            "eos_token": tokenizer.eos_token,
            "pad_token": None,
            "chat_template": tokenizer.chat_template,
            "model_max_length": loaded.engine.max_seq_len,
            "tasks": loaded.pooling.tasks,
        }

    return router
