"""OpenAI's Responses API over the chat path:

    POST   /v1/responses        text or message `input`, `instructions`, function tools, `text.format`,
                                `previous_response_id`, streaming with the Responses events
    GET    /v1/responses/{id}   a kept response (its creator's only)
    DELETE /v1/responses/{id}

A request translates into a chat request (server/responses_schema.py) and is served as
/v1/chat/completions serves it (template, tool calls, structured output, admission, fairness):
its greedy answer is the chat API's for the same conversation. A response is kept for
`previous_response_id` unless `store: false` (server/responses_store.py: bounded, expiring); one
too large to keep is answered with `store: false` and `store_refused` saying why.
An answer cut by `max_output_tokens` is `incomplete` (`response.incomplete` when streamed).
"""

from __future__ import annotations

import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator
from itertools import count

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response
from sse_starlette.sse import EventSourceResponse

from server.access import client_of
from server.assembly import unless_disconnected
from server.errors import OPENAI, OPENAI_TYPES, ApiError, declares
from server.model_repository import ModelRepository
from server.openai_api import Choices, admit_chat, choice_pieces, translated_chat, whole_choice
from server.openai_schema import ChatCompletionRequest
from server.request_body import json_body
from server.responses_schema import ResponsesRequest, chat_messages
from server.responses_store import ResponseStore, StoredResponse

# Chat fields as the Responses API names them, for the errors of the translated request.
NAMES = {
    "messages": "input",
    "max_tokens": "max_output_tokens",
    "response_format": "text.format",
}


class Turn:
    """One request's conversation and the response it is building."""

    def __init__(self, req: ResponsesRequest, client: str, history: list[dict]):
        self.req, self.client = req, client
        self.messages = history + chat_messages(req.items())  # without the instructions
        self.id = "resp_" + uuid.uuid4().hex
        self.created = int(time.time())

    def chat_request(self) -> ChatCompletionRequest:
        req = self.req
        system = [{"role": "system", "content": req.instructions}] if req.instructions else []
        fields = {
            "model": req.model,
            "messages": system + self.messages,
            "max_tokens": req.max_output_tokens,
            "temperature": req.temperature,
            "top_p": req.top_p,
            "tools": req.chat_tools(),
            "tool_choice": req.chat_tool_choice(),
            "parallel_tool_calls": req.parallel_tool_calls,
            "response_format": req.response_format(),
            "user": req.user,
            "cache_salt": req.cache_salt,
            "priority": req.priority,
            "speculate": req.speculate,
        }
        return translated_chat(fields, NAMES)

    def response(self, status: str, output: list[dict], usage: dict | None = None, **extra) -> dict:
        req = self.req
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "error": None,
            "incomplete_details": None,
            "instructions": req.instructions,
            "max_output_tokens": req.max_output_tokens,
            "model": req.model,
            "output": output,
            "parallel_tool_calls": req.parallel_tool_calls is not False,
            "previous_response_id": req.previous_response_id,
            "reasoning": {"effort": None, "summary": None},
            "store": req.keeps,
            "temperature": 1.0 if req.temperature is None else req.temperature,
            "text": req.text_config(),
            "tool_choice": req.echoed_tool_choice(),
            "tools": req.tools or [],
            "top_p": 1.0 if req.top_p is None else req.top_p,
            "truncation": "disabled",
            "usage": usage,
            "user": req.user,
            "metadata": req.metadata or {},
            **extra,
        }

    def finished(self, output: list[dict], finish_reason: str | None, usage: dict) -> dict:
        """The final response: `incomplete` when max_output_tokens cut its text."""
        cut = finish_reason == "length" and not any(item["type"] == "function_call" for item in output)
        return self.response(
            "incomplete" if cut else "completed",
            output,
            usage,
            incomplete_details={"reason": "max_output_tokens"} if cut else None,
        )

    def stored(self, store: ResponseStore, response: dict) -> bytes:
        """The final response as its reply's JSON, kept for previous_response_id unless the request
        said store: false. One too large to keep is not: its reply says `store: false`, and why in
        `store_refused` (a field of this server's: OpenAI's response has none for it)."""
        # ASCII: a response echoes the request's instructions, metadata and tools, whose strings
        # may hold lone surrogates (valid JSON escapes, not encodable as UTF-8)
        body = json.dumps(response).encode()
        if not self.req.keeps:
            return body
        entry = StoredResponse.encoded(self.client, self.messages + output_messages(response), body)
        if store.put(self.id, entry):
            return body
        largest = store.bounds.largest_entry()
        why = (
            f"this response and its conversation take {entry.size} bytes, more than this server keeps "
            f"of one ({max(largest, 0)} bytes, server.responses_entry_bytes and the quotas): it is not "
            "kept (send the conversation again instead of previous_response_id)"
        )
        return json.dumps(response | {"store": False, "store_refused": why}).encode()


def usage(prompt_tokens: int, output_tokens: int) -> dict:
    return {
        "input_tokens": prompt_tokens,
        "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": output_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt_tokens + output_tokens,
    }


def message_item(item_id: str, text: str, status: str = "completed") -> dict:
    content = [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]
    return {"type": "message", "id": item_id, "status": status, "role": "assistant", "content": content}


def call_item(call: dict, status: str = "completed", arguments: str | None = None) -> dict:
    function = call["function"]
    return {
        "type": "function_call",
        "id": "fc_" + call["id"].removeprefix("call_"),
        "call_id": call["id"],
        "name": function["name"],
        "arguments": function["arguments"] if arguments is None else arguments,
        "status": status,
    }


def output_items(content: str | None, calls: list[dict]) -> list[dict]:
    """A message with the text (also an empty one when there is nothing else), then the calls."""
    message = [message_item("msg_" + uuid.uuid4().hex, content or "")] if content or not calls else []
    return message + [call_item(call) for call in calls]


def output_messages(response: dict) -> list[dict]:
    """A response's output as the chat messages that continue its conversation."""
    text = "".join(
        part["text"] for item in response["output"] if item["type"] == "message" for part in item["content"]
    )
    calls = [
        {
            "id": item["call_id"],
            "type": "function",
            "function": {"name": item["name"], "arguments": item["arguments"]},
        }
        for item in response["output"]
        if item["type"] == "function_call"
    ]
    return [{"role": "assistant", "content": text or None, **({"tool_calls": calls} if calls else {})}]


async def whole_response(turn: Turn, answer: Choices, store: ResponseStore) -> bytes:
    choice = await whole_choice(answer)
    response = turn.finished(
        output_items(choice.content, choice.calls),
        choice.finish_reason,
        usage(len(answer.prompt), choice.tokens),
    )
    return turn.stored(store, response)


async def response_events(turn: Turn, answer: Choices, store: ResponseStore) -> AsyncIterator[dict]:
    """The Responses streaming events: created, in_progress, the message's text deltas as they come,
    each function call whole (added, its arguments as one delta, done) at the end, then completed
    (or incomplete, or failed)."""
    numbers = count()

    def event(kind: str, **fields) -> dict:
        data = {"type": kind, "sequence_number": next(numbers), **fields}
        return {"event": kind, "data": json.dumps(data)}  # ASCII, as Turn.stored says

    def message_opened(item_id: str) -> list[dict]:
        """The events that open the answer's message and its (empty) text part."""
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        item = message_item(item_id, "", "in_progress") | {"content": []}
        return [
            event("response.output_item.added", output_index=0, item=item),
            event("response.content_part.added", item_id=item_id, output_index=0, content_index=0, part=part),
        ]

    started = turn.response("in_progress", [])
    yield event("response.created", response=started)
    yield event("response.in_progress", response=started)
    message_id, text, opened = "msg_" + uuid.uuid4().hex, "", False
    calls: list[dict] = []
    last = None
    async with contextlib.aclosing(choice_pieces(answer)) as pieces:
        async for piece in pieces:
            out = last = piece.out
            if out.error:
                code = OPENAI_TYPES.get(out.error_status, "server_error")  # 5xx: server_error
                failed = turn.response("failed", [], None, error={"code": code, "message": out.error})
                yield event("response.failed", response=failed)
                return
            if piece.text and not opened:
                opened = True
                for opening in message_opened(message_id):
                    yield opening
            if piece.text:
                text += piece.text
                yield event(
                    "response.output_text.delta",
                    item_id=message_id,
                    output_index=0,
                    content_index=0,
                    delta=piece.text,
                    logprobs=[],
                )
            calls = piece.calls or calls
    assert last is not None
    if not opened and not calls:  # an empty answer is an empty message, as whole_response gives
        opened = True
        for opening in message_opened(message_id):
            yield opening
    output = []
    if opened:
        done = message_item(message_id, text)
        yield event(
            "response.output_text.done",
            item_id=message_id,
            output_index=0,
            content_index=0,
            text=text,
            logprobs=[],
        )
        yield event(
            "response.content_part.done",
            item_id=message_id,
            output_index=0,
            content_index=0,
            part=done["content"][0],
        )
        yield event("response.output_item.done", output_index=0, item=done)
        output.append(done)
    for call in calls:
        index, item = len(output), call_item(call)
        yield event("response.output_item.added", output_index=index, item=call_item(call, "in_progress", ""))
        yield event(
            "response.function_call_arguments.delta",
            item_id=item["id"],
            output_index=index,
            delta=item["arguments"],
        )
        yield event(
            "response.function_call_arguments.done",
            item_id=item["id"],
            output_index=index,
            name=item["name"],
            arguments=item["arguments"],
        )
        yield event("response.output_item.done", output_index=index, item=item)
        output.append(item)
    response = turn.finished(output, last.finish_reason, usage(len(answer.prompt), last.index))
    kind, body = f"response.{response['status']}", turn.stored(store, response).decode()
    head = json.dumps({"type": kind, "sequence_number": next(numbers)})
    # the response as it was stored, spliced in rather than encoded again
    yield {"event": kind, "data": head[:-1] + ', "response": ' + body + "}"}


def responses_router(repository: ModelRepository, store: ResponseStore) -> APIRouter:
    router = APIRouter(prefix="/v1", dependencies=[declares(OPENAI)])
    responses_request = json_body(ResponsesRequest)

    def kept(response_id: str, client: str, param: str | None = None) -> StoredResponse:
        entry = store.get(response_id, client)
        if entry is None:
            raise ApiError(404, f"no response with id {response_id!r} is kept here", param=param)
        return entry

    @router.post("/responses")
    async def create(http: Request, req: ResponsesRequest = Depends(responses_request)):
        problem = req.unsupported()
        if problem:
            raise ApiError(400, problem, code="unsupported_parameter")
        client = client_of(http.scope)
        history = (
            kept(req.previous_response_id, client, "previous_response_id").messages()
            if req.previous_response_id
            else []
        )
        turn = Turn(req, client, history)
        answer = await admit_chat(http, repository, turn.chat_request(), length_param="max_output_tokens")
        if req.stream:
            return EventSourceResponse(response_events(turn, answer, store))
        reply = await unless_disconnected(http, answer.streams, whole_response(turn, answer, store))
        if isinstance(reply, Response):
            return reply
        return Response(reply, media_type="application/json")

    @router.get("/responses/{response_id}")
    async def retrieve(http: Request, response_id: str):
        # the bytes as they were answered (encoding a large response again would hold the loop)
        entry = kept(response_id, client_of(http.scope))
        return Response(entry.response_json, media_type="application/json")

    @router.delete("/responses/{response_id}")
    async def delete(http: Request, response_id: str):
        if not store.delete(response_id, client_of(http.scope)):
            raise ApiError(404, f"no response with id {response_id!r} is kept here")
        return {"id": response_id, "object": "response", "deleted": True}

    return router
