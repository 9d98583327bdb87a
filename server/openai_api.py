"""OpenAI-compatible endpoints over the same engine and answer streams: /v1/models, /v1/completions,
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
from collections.abc import AsyncGenerator

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response
from sse_starlette.sse import EventSourceResponse

from server import tool_calls
from server.access import client_of
from server.assembly import (
    AnswerRequest,
    admit,
    check_answer_fits,
    check_reply_size,
    compile_grammar,
    sampling_params,
    unless_disconnected,
)
from server.errors import OPENAI_TYPES, ApiError
from server.model_repository import LoadedModel, ModelRepository
from server.openai_schema import ChatCompletionRequest, CompletionRequest
from server.output import AnswerStream, GeneratedToken, GenerationOutput
from server.request_body import json_body

CREATED = int(time.time())


async def _merged(streams: list[AnswerStream]) -> AsyncGenerator[tuple[int, GenerationOutput]]:
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


def openai_router(repository: ModelRepository) -> APIRouter:
    router = APIRouter(prefix="/v1")

    @router.get("/models")
    async def models():
        """Every name (aliases too) of every model, with the model's state (READY: served now)."""
        return {
            "object": "list",
            "data": [
                {
                    "id": name,
                    "object": "model",
                    "created": CREATED,
                    "owned_by": "ms-llm-serving",
                    "root": model.name,
                    "state": model.state,
                    **({"reason": model.reason} if model.reason else {}),
                }
                for model in repository.models.values()
                for name in model.names
            ],
        }

    def check(req) -> LoadedModel:
        model = repository.serving(req.model)
        problem = req.unsupported()
        if problem:
            raise ApiError(400, problem, code="unsupported_parameter")
        return model

    async def respond(http: Request, model: LoadedModel, req, prompt: list[int], max_tokens: int, chat: bool):
        formatter = model.formatter
        # Temperature 0 is greedy; choice i samples with seed + i.
        top = req.top_logprobs_asked()
        samplings = [
            sampling_params(
                req,
                req.temperature > 0,
                None if req.seed is None else req.seed + i,
                model.tokenizer.vocab_size,
                logprobs=top,
                logit_bias=req.bias_pairs(),
            )
            for i in range(req.n)
        ]
        calls = chat and tool_calls.offered(req)  # the answers are read for tool calls
        call_grammar = tool_calls.call_grammar(req) if chat else None
        if call_grammar is not None:
            if req.grammar_spec() is not None:
                raise ApiError(
                    400,
                    "tool_choice and response_format both constrain the answer: send one",
                    param="tool_choice",
                )
            grammar = await compile_grammar(model.grammars, lambda: call_grammar, "tools", 400)
        else:
            param = "structured_outputs" if req.structured_outputs else "response_format"
            grammar = await compile_grammar(model.grammars, req.grammar_spec, param, 400)
        if top is not None and not req.stream:
            check_reply_size(req.n, max_tokens, top, model.config.server.max_reply_logprobs)
        request = AnswerRequest(
            prompt,
            samplings,
            max_tokens,
            tuple(req.stop),
            req.ignore_eos,
            grammar,
            req.cache_salt,
            client_of(http.scope),
            req.priority,
        )
        streams = await admit(model.engine, model.outputs, request, openai=True)
        object_name = "chat.completion" if chat else "text_completion"
        reply_id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex

        def envelope(choices: list[dict], chunk: bool) -> dict:
            return {
                "id": reply_id,
                "object": object_name + (".chunk" if chunk and chat else ""),
                "created": int(time.time()),
                "model": req.model,
                "choices": choices,
            }

        def usage(completion_tokens: int) -> dict:
            return {
                "prompt_tokens": len(prompt),
                "completion_tokens": completion_tokens,
                "total_tokens": len(prompt) + completion_tokens,
            }

        def logprobs(i: int, tokens: list[GeneratedToken]) -> dict | None:
            """Choice i's logprobs of these tokens (its next ones), if the request asked."""
            if top is None:
                return None
            if chat:
                return {"content": formatter.chat(tokens)}
            shown = formatter.completion(tokens, offsets[i])
            offsets[i] += sum(map(len, shown["tokens"]))
            return shown

        offsets = [0] * req.n  # completions: characters of each choice's tokens so far

        async def whole() -> Response:
            texts, tokens = [""] * req.n, [0] * req.n
            generated: list[list[GeneratedToken]] = [[] for _ in range(req.n)]
            reasons: list[str | None] = [None] * req.n
            async with contextlib.aclosing(_merged(streams)) as merged:
                async for i, out in merged:
                    if out.error:
                        raise ApiError(out.error_status, out.error)
                    texts[i] += out.text
                    tokens[i] = out.index
                    generated[i] += out.tokens
                    reasons[i] = out.finish_reason

            def body() -> bytes:
                return json.dumps(reply(texts, tokens, generated, reasons), ensure_ascii=False).encode()

            # Off the event loop: choices of thousands of tokens with their top logprobs take
            # seconds to shape and encode, during which no other request (nor /health) would answer.
            return Response(await asyncio.to_thread(body), media_type="application/json")

        def reply(
            texts: list[str],
            tokens: list[int],
            generated: list[list[GeneratedToken]],
            reasons: list[str | None],
        ) -> dict:
            choices = [
                {"index": i, "message": {"role": "assistant", "content": texts[i]}}
                if chat
                else {"index": i, "text": texts[i]}
                for i in range(req.n)
            ]
            for i, choice in enumerate(choices):
                choice["logprobs"] = logprobs(i, generated[i])
                choice["finish_reason"] = reasons[i]
                if calls:
                    content, found = tool_calls.parse_calls(texts[i], req.tools, req.parallel_tool_calls)
                    if found:
                        choice["message"] = {"role": "assistant", "content": content, "tool_calls": found}
                        choice["finish_reason"] = "tool_calls"
            return {**envelope(choices, False), "usage": usage(sum(tokens))}

        if not req.stream:
            return await unless_disconnected(http, streams, whole())

        include_usage = bool(req.stream_options and req.stream_options.include_usage)

        watchers = (
            [tool_calls.CallWatcher(req.tools, req.parallel_tool_calls) for _ in range(req.n)]
            if calls
            else []
        )

        def piece(i: int, out: GenerationOutput | None, text: str = "", reason: str | None = None) -> dict:
            """Choice i's chunk of this output (None: the first chunk, with the role): `text`, and
            `reason` when it finishes."""
            shown = logprobs(i, out.tokens) if out and out.tokens else None
            if chat:
                delta = (
                    {"role": "assistant", "content": ""}
                    if out is None
                    else ({"content": text} if text else {})
                )
                return {"index": i, "delta": delta, "logprobs": shown, "finish_reason": reason}
            return {"index": i, "text": text, "logprobs": shown, "finish_reason": reason}

        async def events():
            tokens = [0] * req.n
            if chat:
                yield json.dumps(envelope([piece(i, None) for i in range(req.n)], True))
            async with contextlib.aclosing(_merged(streams)) as merged:
                async for i, out in merged:
                    if out.error:
                        yield json.dumps(
                            {
                                "error": {
                                    "message": out.error,
                                    "type": OPENAI_TYPES.get(out.error_status, "server_error"),
                                    "param": None,
                                    "code": out.error_status,
                                }
                            }
                        )
                        break
                    tokens[i] = out.index
                    text, reason = out.text, out.finish_reason
                    found: list[dict] = []
                    if calls:  # text that may be a call waits; calls go out whole at the end
                        text = watchers[i].feed(out.text)
                        if out.finished:
                            rest, found = watchers[i].finish()
                            text += rest
                    if found:
                        if text:
                            yield json.dumps(envelope([piece(i, out, text)], True), ensure_ascii=False)
                        delta = {"tool_calls": [{"index": k, **call} for k, call in enumerate(found)]}
                        chunk = {"index": i, "delta": delta, "logprobs": None, "finish_reason": None}
                        yield json.dumps(envelope([chunk], True), ensure_ascii=False)
                        yield json.dumps(envelope([piece(i, None, "", "tool_calls") | {"delta": {}}], True))
                    elif text or out.finished or (top is not None and out.tokens):
                        yield json.dumps(envelope([piece(i, out, text, reason)], True), ensure_ascii=False)
            if include_usage:
                yield json.dumps({**envelope([], True), "usage": usage(sum(tokens))})
            yield "[DONE]"

        return EventSourceResponse(events())

    completion_request, chat_request = json_body(CompletionRequest), json_body(ChatCompletionRequest)

    def answer_length(model: LoadedModel, prompt_len: int, asked: int | None, param: str) -> int:
        """No max_tokens: up to the context (as OpenAI); one that can never fit: 400 naming it."""
        context = model.engine.max_seq_len
        if asked is None:
            return context
        check_answer_fits(prompt_len, asked, context, True, param)
        return asked

    @router.post("/completions")
    async def completions(http: Request, req: CompletionRequest = Depends(completion_request)):
        model = check(req)
        prompt = await model.encoder.encode(req.text, param="prompt")
        return await respond(
            http,
            model,
            req,
            prompt,
            answer_length(model, len(prompt), req.max_tokens, "max_tokens"),
            chat=False,
        )

    @router.post("/chat/completions")
    async def chat_completions(http: Request, req: ChatCompletionRequest = Depends(chat_request)):
        model = check(req)
        takes_tools = model.tokenizer.template_takes_tools
        messages = tool_calls.template_messages(req, takes_tools)
        tools = tool_calls.template_tools(req) if takes_tools else None
        prompt = await model.encoder.encode_chat(messages, param="messages", tools=tools)
        asked, param = (
            (req.max_completion_tokens, "max_completion_tokens")
            if req.max_completion_tokens
            else (req.max_tokens, "max_tokens")
        )
        return await respond(
            http, model, req, prompt, answer_length(model, len(prompt), asked, param), chat=True
        )

    return router
