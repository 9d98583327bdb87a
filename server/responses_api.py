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
A reasoning model's thinking (server/reasoning.py) is a `reasoning` output item before the message
(its text a `reasoning_text` part, streamed as response.reasoning_text.delta); `reasoning.summary`
is accepted for such a model (no summary is written: the whole thinking is given), effort levels
are refused. `chat_template_kwargs` reach the template as on /v1/chat/completions.
"""

from __future__ import annotations

import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from itertools import count

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response
from sse_starlette.sse import EventSourceResponse

from server.access import client_of
from server.client_disconnect import unless_disconnected
from server.errors import OPENAI, OPENAI_TYPES, ApiError, declares
from server.model_repository import ModelRepository
from server.openai_api import admit_chat, translated_chat
from server.openai_choices import Choices, choice_pieces, whole_choice
from server.openai_schema import ChatCompletionRequest
from server.request_body import json_body
from server.responses_schema import ResponsesRequest, chat_messages
from server.responses_store import ResponseStore, StoredResponse

# Chat fields as the Responses API names them, for the errors of the translated request.
NAMES = {
    "messages": "input",
    "max_tokens": "max_output_tokens",
    "response_format": "text.format",
    # The budget sits in `reasoning`, where Responses keeps its reasoning settings (effort, summary),
    # named as OpenRouter's reasoning.max_tokens names it, rather than the chat API's extension field.
    "max_thinking_tokens": "reasoning.max_tokens",
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
            "min_p": req.min_p,
            "typical_p": req.typical_p,
            "tools": req.chat_tools(),
            "tool_choice": req.chat_tool_choice(),
            "parallel_tool_calls": req.parallel_tool_calls,
            "response_format": req.response_format(),
            "user": req.user,
            "cache_salt": req.cache_salt,
            "priority": req.priority,
            "speculate": req.speculate,
            "chat_template_kwargs": req.chat_template_kwargs,
            "max_thinking_tokens": (req.reasoning or {}).get("max_tokens"),
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
            "reasoning": req.echoed_reasoning(),
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


def usage(prompt_tokens: int, output_tokens: int, reasoning_tokens: int = 0) -> dict:
    return {
        "input_tokens": prompt_tokens,
        "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": output_tokens,
        "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
        "total_tokens": prompt_tokens + output_tokens,
    }


def message_item(item_id: str, text: str, status: str = "completed") -> dict:
    content = [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]
    return {"type": "message", "id": item_id, "status": status, "role": "assistant", "content": content}


def reasoning_item(item_id: str, text: str, status: str = "completed") -> dict:
    """A reasoning model's thinking: its text as OpenAI's open-weight models give it (a
    reasoning_text part), no summary (none is written)."""
    content = [{"type": "reasoning_text", "text": text}]
    return {"type": "reasoning", "id": item_id, "summary": [], "content": content, "status": status}


@dataclass
class Part:
    """A streamed item of one text part (a reasoning item's or the message's)."""

    item_id: str
    kind: str  # its part's type: reasoning_text or output_text
    text: str = ""
    index: int | None = None  # its output index, once opened
    done: bool = False

    def where(self) -> dict:
        return {"item_id": self.item_id, "output_index": self.index}

    def shape(self, text: str) -> dict:
        if self.kind == "reasoning_text":
            return {"type": "reasoning_text", "text": text}
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


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


def output_items(content: str | None, calls: list[dict], thought: str | None = None) -> list[dict]:
    """A reasoning model's reasoning item, a message with the text (also an empty one when there is
    nothing else), then the calls."""
    reasoning = [reasoning_item("rs_" + uuid.uuid4().hex, thought)] if thought else []
    message = [message_item("msg_" + uuid.uuid4().hex, content or "")] if content or not calls else []
    return reasoning + message + [call_item(call) for call in calls]


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
        output_items(choice.content, choice.calls, choice.reasoning),
        choice.finish_reason,
        usage(len(answer.prompt), choice.tokens, answer.reasoning_tokens()),
    )
    return turn.stored(store, response)


class EventWriter:
    """Numbers a Responses stream's events and keeps its output items done so far, in order."""

    def __init__(self) -> None:
        self.numbers = count()
        self.output: list[dict] = []

    def event(self, kind: str, **fields) -> dict:
        data = {"type": kind, "sequence_number": next(self.numbers), **fields}
        return {"event": kind, "data": json.dumps(data)}  # ASCII, as Turn.stored says

    def opened(self, part: Part) -> list[dict]:
        """The events that open an item and its one (empty) part, at the next output index."""
        part.index = len(self.output)
        if part.kind == "reasoning_text":
            item = reasoning_item(part.item_id, "", "in_progress") | {"content": []}
        else:
            item = message_item(part.item_id, "", "in_progress") | {"content": []}
        return [
            self.event("response.output_item.added", output_index=part.index, item=item),
            self.event("response.content_part.added", content_index=0, part=part.shape(""), **part.where()),
        ]

    def delta(self, part: Part, text: str) -> list[dict]:
        """The events of `text` added to `part` (opened first if it is not yet)."""
        events = [] if part.index is not None else self.opened(part)
        part.text += text
        if part.kind == "reasoning_text":
            return events + [
                self.event("response.reasoning_text.delta", content_index=0, delta=text, **part.where())
            ]
        return events + [
            self.event("response.output_text.delta", content_index=0, delta=text, logprobs=[], **part.where())
        ]

    def closed(self, part: Part) -> list[dict]:
        """The events that end an item opened, which joins the output."""
        part.done = True
        reasons = part.kind == "reasoning_text"
        done = reasoning_item(part.item_id, part.text) if reasons else message_item(part.item_id, part.text)
        self.output.append(done)
        ended = "response.reasoning_text.done" if reasons else "response.output_text.done"
        text_fields: dict = {} if reasons else {"logprobs": []}
        return [
            self.event(ended, content_index=0, text=part.text, **part.where(), **text_fields),
            self.event(
                "response.content_part.done", content_index=0, part=done["content"][0], **part.where()
            ),
            self.event("response.output_item.done", output_index=part.index, item=done),
        ]

    def call(self, call: dict) -> list[dict]:
        """A function call's events, whole: added, its arguments as one delta, done."""
        index, item = len(self.output), call_item(call)
        self.output.append(item)
        where = {"item_id": item["id"], "output_index": index}
        return [
            self.event(
                "response.output_item.added", output_index=index, item=call_item(call, "in_progress", "")
            ),
            self.event("response.function_call_arguments.delta", **where, delta=item["arguments"]),
            self.event(
                "response.function_call_arguments.done",
                **where,
                name=item["name"],
                arguments=item["arguments"],
            ),
            self.event("response.output_item.done", output_index=index, item=item),
        ]

    def final(self, kind: str, stored: bytes) -> dict:
        """The last event, the response as it was stored spliced in rather than encoded again."""
        head = json.dumps({"type": kind, "sequence_number": next(self.numbers)})
        return {"event": kind, "data": head[:-1] + ', "response": ' + stored.decode() + "}"}


async def response_events(turn: Turn, answer: Choices, store: ResponseStore) -> AsyncIterator[dict]:
    """The Responses streaming events: created, in_progress, a reasoning model's reasoning item
    (its reasoning_text deltas as it thinks), the message's text deltas as they come, each function
    call whole (added, its arguments as one delta, done) at the end, then completed (or
    incomplete, or failed)."""
    events = EventWriter()
    thinking = Part("rs_" + uuid.uuid4().hex, "reasoning_text")
    message = Part("msg_" + uuid.uuid4().hex, "output_text")
    started = turn.response("in_progress", [])
    yield events.event("response.created", response=started)
    yield events.event("response.in_progress", response=started)
    calls: list[dict] = []
    last = None
    async with contextlib.aclosing(choice_pieces(answer)) as pieces:
        async for piece in pieces:
            out = last = piece.out
            if out.error:
                code = OPENAI_TYPES.get(out.error_status, "server_error")  # 5xx: server_error
                failed = turn.response("failed", [], None, error={"code": code, "message": out.error})
                yield events.event("response.failed", response=failed)
                return
            for e in events.delta(thinking, piece.reasoning) if piece.reasoning else []:
                yield e
            if piece.text:
                for e in events.closed(thinking) if thinking.index is not None and not thinking.done else []:
                    yield e
                for e in events.delta(message, piece.text):
                    yield e
            calls = piece.calls or calls
    assert last is not None
    ends = events.closed(thinking) if thinking.index is not None and not thinking.done else []
    if message.index is None and not calls:  # an empty answer is an empty message, as whole_response gives
        ends += events.opened(message)
    if message.index is not None:
        ends += events.closed(message)
    for call in calls:
        ends += events.call(call)
    for e in ends:
        yield e
    used = usage(len(answer.prompt), last.index, answer.reasoning_tokens())
    response = turn.finished(events.output, last.finish_reason, used)
    kind = f"response.{response['status']}"
    yield events.final(kind, turn.stored(store, response))


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
        # whether the model reasons matters only where reasoning is asked (an unknown model: 404)
        problem = req.unsupported(req.reasoning_asked and repository.serving(req.model).reasons)
        if problem:
            raise ApiError(400, problem, code="unsupported_parameter")
        client = client_of(http.scope)
        history = (
            kept(req.previous_response_id, client, "previous_response_id").messages()
            if req.previous_response_id
            else []
        )
        turn = Turn(req, client, history)
        answer = await admit_chat(
            http,
            repository,
            turn.chat_request(),
            length_param="max_output_tokens",
            thinking_param=NAMES["max_thinking_tokens"],
        )
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
