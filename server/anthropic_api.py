"""Anthropic's Messages API over the chat path, so that the `anthropic` package works unchanged:

    POST /v1/messages               system, messages with text / tool_use / tool_result blocks,
                                    tools, tool_choice, stop_sequences, temperature / top_p /
                                    top_k (default 1.0 / 1.0 / none; the 2026 client sends them
                                    through extra_body), output_config.format (a JSON Schema),
                                    thinking (a reasoning model's thinking as `thinking` blocks:
                                    server/reasoning.py), chat_template_kwargs, streaming (message_start,
                                    content_block_start/delta/stop, message_delta, message_stop)
    POST /v1/messages/count_tokens  {"input_tokens": the prompt's tokens}

A request translates into a chat request (server/anthropic_schema.py) and is served as
/v1/chat/completions serves it. The key may come as `x-api-key` (server/access.py); errors are
Anthropic's `{"type": "error", "error": {"type", "message"}}` (server/errors.py).
"""

from __future__ import annotations

import contextlib
import json
import uuid
from collections.abc import AsyncIterator

from fastapi import APIRouter, Depends, Request
from sse_starlette.sse import EventSourceResponse

from server.admission import prompt_tokens
from server.anthropic_schema import CountTokensRequest, MessagesRequest
from server.client_disconnect import unless_disconnected
from server.errors import ANTHROPIC, ApiError, declares, error_body
from server.model_repository import ModelRepository
from server.openai_api import admit_chat, chat_text, serving, translated_chat
from server.openai_choices import Choices, choice_pieces, whole_choice
from server.request_body import json_body

# Chat fields as Anthropic names them, for the errors of the translated request.
NAMES = {
    "stop": "stop_sequences",
    "response_format": "output_config.format",
    "max_thinking_tokens": "thinking.budget_tokens",
}


def stop_reason(finish_reason: str | None, stop_sequence: str | None, calls: list[dict]) -> str:
    if calls:
        return "tool_use"
    if finish_reason == "length":
        return "max_tokens"
    return "stop_sequence" if stop_sequence is not None else "end_turn"


def tool_use(call: dict) -> dict:
    """An OpenAI-shaped call as a tool_use block."""
    return {
        "type": "tool_use",
        "id": "toolu_" + call["id"].removeprefix("call_"),
        "name": call["function"]["name"],
        "input": json.loads(call["function"]["arguments"]),
    }


def message(
    req: MessagesRequest, content: list[dict], reason: str | None, stop: str | None, usage: dict
) -> dict:
    return {
        "id": "msg_" + uuid.uuid4().hex,
        "type": "message",
        "role": "assistant",
        "model": req.model,
        "content": content,
        "stop_reason": reason,
        "stop_sequence": stop,
        "usage": usage,
    }


def thinking_block(text: str) -> dict:
    # No signature: the thinking is the model's own text, sent back only to be dropped.
    return {"type": "thinking", "thinking": text, "signature": ""}


async def whole_message(req: MessagesRequest, answer: Choices) -> dict:
    choice = await whole_choice(answer)
    thought = [thinking_block(choice.reasoning)] if choice.reasoning else []
    text = [{"type": "text", "text": choice.content or ""}] if choice.content or not choice.calls else []
    content = thought + text + [tool_use(call) for call in choice.calls]
    reason = stop_reason(choice.finish_reason, choice.stop_sequence, choice.calls)
    usage = {"input_tokens": len(answer.prompt), "output_tokens": choice.tokens}
    return message(req, content, reason, choice.stop_sequence, usage)


async def message_events(req: MessagesRequest, answer: Choices) -> AsyncIterator[dict]:
    """The streaming events: message_start, a thinking block (a reasoning model's, as it thinks:
    thinking_delta), a text block whose deltas come as the text does, each tool_use block whole
    at the end (its input as one input_json_delta), message_delta with the stop reason and usage,
    message_stop; an `error` event if the answer fails."""
    start = message(req, [], None, None, {"input_tokens": len(answer.prompt), "output_tokens": 0})
    yield _event("message_start", message=start)
    yield _event("ping")
    blocks, last, calls = _StreamedBlocks(), None, list[dict]()
    async with contextlib.aclosing(choice_pieces(answer)) as pieces:
        async for piece in pieces:
            last = piece.out
            if last.error:
                yield {
                    "event": "error",
                    "data": json.dumps(error_body(last.error_status, last.error, "anthropic")),
                }
                return
            for streamed in blocks.delta("thinking", piece.reasoning) + blocks.delta("text", piece.text):
                yield streamed
            calls = piece.calls or calls
    assert last is not None
    if blocks.open != "text" and not calls:  # no text: one empty text block, as whole_message gives
        for opening in blocks.opened("text"):
            yield opening
    for closing in blocks.closed():
        yield closing
    for index, call in enumerate(calls, start=blocks.count):  # after the thinking and text blocks
        block = tool_use(call)
        yield _event("content_block_start", index=index, content_block={**block, "input": {}})
        delta = {"type": "input_json_delta", "partial_json": call["function"]["arguments"]}
        yield _event("content_block_delta", index=index, delta=delta)
        yield _event("content_block_stop", index=index)
    reason = stop_reason(last.finish_reason, last.stop_sequence, calls)
    yield _event(
        "message_delta",
        delta={"stop_reason": reason, "stop_sequence": last.stop_sequence},
        usage={"output_tokens": last.index},
    )
    yield _event("message_stop")


def _event(kind: str, **fields) -> dict:
    return {"event": kind, "data": json.dumps({"type": kind, **fields}, ensure_ascii=False)}


class _StreamedBlocks:
    """A streamed message's thinking and text blocks: how many opened so far, and the open one's
    type, closed before the next opens."""

    def __init__(self) -> None:
        self.count = 0
        self.open: str | None = None

    def delta(self, kind: str, text: str | None) -> list[dict]:
        """The events of `text` in a block of `kind` (thinking_delta or text_delta), after those that
        open the block; none for no text."""
        if not text:
            return []
        delta = {"type": f"{kind}_delta", kind: text}
        return [*self.opened(kind), _event("content_block_delta", index=self.count - 1, delta=delta)]

    def opened(self, kind: str) -> list[dict]:
        """The events that close the open block (if another) and open one of this kind."""
        if self.open == kind:
            return []
        events = self.closed()
        self.open, self.count = kind, self.count + 1
        start = thinking_block("") if kind == "thinking" else {"type": "text", "text": ""}
        return [*events, _event("content_block_start", index=self.count - 1, content_block=start)]

    def closed(self) -> list[dict]:
        return [_event("content_block_stop", index=self.count - 1)] if self.open else []


def anthropic_router(repository: ModelRepository) -> APIRouter:
    router = APIRouter(prefix="/v1/messages", dependencies=[declares(ANTHROPIC)])
    messages_request, count_request = json_body(MessagesRequest), json_body(CountTokensRequest)

    def refuse_unsupported(req: CountTokensRequest) -> None:
        thinks = (req.thinking or {}).get("type") not in (None, "disabled")
        # whether the model reasons matters only where thinking is asked (an unknown model: 404)
        problem = req.unsupported(thinks and repository.serving(req.model).reasons)
        if problem:
            raise ApiError(400, problem)

    @router.post("")
    async def create(http: Request, req: MessagesRequest = Depends(messages_request)):
        refuse_unsupported(req)
        chat = translated_chat(req.chat_fields(), NAMES)
        answer = await admit_chat(
            http, repository, chat, style=ANTHROPIC, thinking_param=NAMES["max_thinking_tokens"]
        )
        if req.stream:
            return EventSourceResponse(message_events(req, answer))
        return await unless_disconnected(http, answer.streams, whole_message(req, answer))

    @router.post("/count_tokens")
    async def count_tokens(req: CountTokensRequest = Depends(count_request)):
        refuse_unsupported(req)
        chat = translated_chat(req.chat_fields(), NAMES)
        model = serving(repository, chat)
        return {"input_tokens": len(await prompt_tokens(model.encoder, chat_text(model, chat)))}

    return router
