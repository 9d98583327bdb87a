"""OpenAI-compatible endpoints over the same LLMServer: /v1/models, /v1/completions,
/v1/chat/completions, streaming (SSE chunks ending with `data: [DONE]`) or not.

Temperature 0 is greedy; `n` runs n sequences in the batch (seeds seed, seed+1, ... when a seed is
given); usage counts prompt tokens and generated tokens (an EOS that ended a choice included).
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from typing import AsyncIterator

from fastapi import APIRouter, Depends
from sse_starlette.sse import EventSourceResponse

from agent.contract.sampling import SamplingParams
from config.schema import ServingConfig
from scheduler.batch_scheduler import AdmissionError
from server.errors import ApiError
from server.llm_server import AnswerStream, GenerationOutput, LLMServer
from server.openai_schema import ChatCompletionRequest, CompletionRequest
from server.request_body import json_body
from agent.model.tokenizer import TextTokenizer, TokenizerError

CREATED = int(time.time())


async def _merged(streams: list[AnswerStream]) -> AsyncIterator[tuple[int, GenerationOutput]]:
    """The outputs of n streams as (choice index, output), in arrival order; closing this closes all."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, stream):
        async with contextlib.aclosing(stream):
            async for out in stream:
                await queue.put((index, out))
        await queue.put((index, None))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        open_streams = len(streams)
        while open_streams:
            index, out = await queue.get()
            if out is None:
                open_streams -= 1
            else:
                yield index, out
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for stream in streams:  # a pump cancelled before it started never closed its stream
            await stream.aclose()


def openai_router(config: ServingConfig, tokenizer: TextTokenizer, llm_server: LLMServer) -> APIRouter:
    router = APIRouter(prefix="/v1")
    served = [config.model.name, *config.model.aliases]

    @router.get("/models")
    async def models():
        return {"object": "list", "data": [{"id": name, "object": "model", "created": CREATED,
                                            "owned_by": "ms-llm-serving"} for name in served]}

    def check(req) -> None:
        if req.model not in served:
            raise ApiError(404, f"model {req.model!r} is not served here; served: {', '.join(served)}",
                           param="model", code="model_not_found")
        problem = req.unsupported()
        if problem:
            raise ApiError(400, problem, code="unsupported_parameter")

    async def start(req, prompt: list[int], max_tokens: int) -> list[AnswerStream]:
        streams = []
        try:
            for i in range(req.n):
                sampling = SamplingParams(
                    do_sample=req.temperature > 0, temperature=req.temperature, top_k=req.top_k,
                    top_p=req.top_p, repetition_penalty=req.repetition_penalty,
                    presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
                    seed=None if req.seed is None else req.seed + i)
                streams.append(llm_server.generate_answer(uuid.uuid4().hex, prompt, sampling, max_tokens,
                                                          tuple(req.stop), req.ignore_eos))
        except AdmissionError as exc:
            for stream in streams:  # admitted choices of a refused request go too
                await stream.aclose()
            # OpenAI's clients expect 429 for "no room now" (and retry it).
            raise ApiError(429 if exc.overload else exc.status, str(exc)) from exc
        return streams

    async def respond(req, prompt: list[int], max_tokens: int, chat: bool):
        streams = await start(req, prompt, max_tokens)
        object_name = "chat.completion" if chat else "text_completion"
        reply_id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex

        def envelope(choices: list[dict], chunk: bool) -> dict:
            return {"id": reply_id, "object": object_name + (".chunk" if chunk and chat else ""),
                    "created": int(time.time()), "model": req.model, "choices": choices}

        def usage(completion_tokens: int) -> dict:
            return {"prompt_tokens": len(prompt), "completion_tokens": completion_tokens,
                    "total_tokens": len(prompt) + completion_tokens}

        if not req.stream:
            texts, reasons, tokens = [""] * req.n, [None] * req.n, [0] * req.n
            async with contextlib.aclosing(_merged(streams)) as outputs:
                async for i, out in outputs:
                    if out.error:
                        raise ApiError(503, out.error)
                    texts[i] += out.text
                    tokens[i] = out.index
                    reasons[i] = out.finish_reason
            choices = [{"index": i, "message": {"role": "assistant", "content": texts[i]}} if chat else
                       {"index": i, "text": texts[i], "logprobs": None} for i in range(req.n)]
            for i, choice in enumerate(choices):
                choice["finish_reason"] = reasons[i]
            return {**envelope(choices, False), "usage": usage(sum(tokens))}

        include_usage = bool(req.stream_options and req.stream_options.include_usage)

        def piece(i: int, text: str | None, finish_reason: str | None, role: bool = False) -> dict:
            if chat:
                delta = {"role": "assistant", "content": ""} if role else ({"content": text} if text else {})
                return {"index": i, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
            return {"index": i, "text": text or "", "logprobs": None, "finish_reason": finish_reason}

        async def events():
            tokens = [0] * req.n
            if chat:
                yield json.dumps(envelope([piece(i, None, None, role=True) for i in range(req.n)], True))
            async with contextlib.aclosing(_merged(streams)) as outputs:
                async for i, out in outputs:
                    if out.error:
                        yield json.dumps({"error": {"message": out.error, "type": "server_error",
                                                    "param": None, "code": 503}})
                        break
                    tokens[i] = out.index
                    if out.text or out.finished:
                        yield json.dumps(envelope([piece(i, out.text, out.finish_reason)], True),
                                         ensure_ascii=False)
            if include_usage:
                yield json.dumps({**envelope([], True), "usage": usage(sum(tokens))})
            yield "[DONE]"

        return EventSourceResponse(events())

    @router.post("/completions")
    async def completions(req: CompletionRequest = Depends(json_body(CompletionRequest))):
        check(req)
        prompt = tokenizer.encode(req.text)
        return await respond(req, prompt, req.max_tokens or llm_server.max_seq_len, chat=False)

    @router.post("/chat/completions")
    async def chat_completions(req: ChatCompletionRequest = Depends(json_body(ChatCompletionRequest))):
        check(req)
        try:
            prompt = tokenizer.encode_chat([{"role": m.role, "content": m.text()} for m in req.messages])
        except TokenizerError as exc:
            raise ApiError(400, str(exc), param="messages") from exc
        max_tokens = req.max_completion_tokens or req.max_tokens or llm_server.max_seq_len
        return await respond(req, prompt, max_tokens, chat=True)

    return router
