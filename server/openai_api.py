"""OpenAI-compatible endpoints over the same engine and answer streams: /v1/models, /v1/completions,
/v1/chat/completions, streaming (SSE chunks ending with `data: [DONE]`) or not.

Temperature 0 is greedy; `n` runs n sequences in the batch (seeds seed, seed+1, ... when a seed is
given); usage counts prompt tokens and generated tokens (an EOS that ended a choice included).
Completions take a prompt as text or token ids, or a list of them (n choices each, in order), and
`echo` (the prompt, with its logprobs where `logprobs` is asked, before each choice's text); both
APIs take vLLM's `prompt_logprobs` (agent/contract/prompt_logprobs.py says what they are).

A request is admitted by `admit_choices` into a Choices context (server/openai_choices.py: the
request, its model, prompt and answer streams); `whole_reply` and `stream_events` read that context
into OpenAI's two shapes. The APIs that translate into a chat request (Responses, Anthropic's
Messages: `translated_chat`) are admitted by `admit_chat` and read their one choice with
openai_choices' `whole_choice` or `choice_pieces`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Callable, Mapping

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response
from pydantic import ValidationError
from sse_starlette.sse import EventSourceResponse

from agent.contract.prompt_logprobs import PromptLogprob
from server import reasoning, tool_calls
from server.access import client_of
from server.admission import Admission, Prompt, admit_answers
from server.client_disconnect import unless_disconnected
from server.collect import collected, merged
from server.errors import OPENAI, ApiError, ApiStyle, declares, error_body
from server.model_repository import LoadedModel, ModelRepository
from server.openai_choices import CREATED, Choices, OpenAIRequest, held
from server.openai_schema import ChatCompletionRequest, CompletionRequest
from server.output import GeneratedToken, GenerationOutput
from server.request_body import json_body
from server.structured_output import GrammarSpec


async def admit_choices(
    http: Request,
    model: LoadedModel,
    req: OpenAIRequest,
    prompt: Prompt,
    length: tuple[int | None, str],
    chat: bool,
    style: ApiStyle = OPENAI,
    thinking_param: str = "max_thinking_tokens",
) -> Choices:
    """The request's choices admitted (choice i samples with seed + i), with their grammar;
    `length`: the answer length asked (None: up to the context) and how the API names it;
    `thinking_param`: how it names the thinking budget."""
    top = req.top_logprobs_asked()
    grammar: Callable[[], GrammarSpec | None] = req.grammar_spec
    grammar_param = "structured_outputs" if req.structured_outputs else "response_format"
    settings = model.config.model
    call_format = tool_calls.call_format(model.tokenizer.chat_template, settings.tool_call_parser)
    call_grammar = None
    if isinstance(req, ChatCompletionRequest):
        call_grammar = tool_calls.call_grammar(req, call_format)
    if call_grammar is not None:
        assert isinstance(req, ChatCompletionRequest)
        # Asked, not built: building a schema given as text can fail, and that is no 500.
        if req.structured_outputs or (req.response_format and req.response_format.type != "text"):
            raise ApiError(
                400,
                "tool_choice and response_format both constrain the answer: send one",
                param="tool_choice",
            )
        grammar, grammar_param = (lambda: call_grammar), "tools"
    calls = isinstance(req, ChatCompletionRequest) and tool_calls.offered(req)
    admission = Admission(
        prompt=prompt,
        sampling=req,
        do_sample=req.temperature > 0,
        seeds=tuple(None if req.seed is None else req.seed + i for i in range(req.n)),
        max_tokens=length[0],
        max_tokens_param=length[1],
        sampling_fields={
            "logprobs": top,
            "logit_bias": req.logit_bias,
            "prompt_logprobs": req.prompt_logprobs_asked(),
        },
        stop=tuple(req.stop),
        ignore_eos=req.ignore_eos,
        grammar=grammar,
        grammar_param=grammar_param,
        whole=not req.stream,
        cache_salt=req.cache_salt,
        client=client_of(http.scope),
        priority=req.priority,
        speculate=req.speculate,
        thinking_budget=req.max_thinking_tokens if isinstance(req, ChatCompletionRequest) else None,
        thinking_param=thinking_param,
        shown_tokens=shown_markers(model, chat, call_format if calls else None),
    )
    admitted = await admit_answers(model, style, admission)
    answer = Choices(req, model, admitted.prompt, admitted.streams, chat, top, calls, call_format=call_format)
    if chat:
        answer.thinks = reasoning.of_answers(model.tokenizer, settings.reasoning_parser, admitted.prompt)
    return answer


def shown_markers(model: LoadedModel, chat: bool, call_format: str | None) -> frozenset[int]:
    """The special tokens a choice's text keeps: the tool call format's markers (when tools are
    offered) and a chat's think tags, where the vocabulary holds them as special tokens."""
    shown = frozenset() if call_format is None else tool_calls.shown_markers(model.tokenizer, call_format)
    if chat:
        tags = reasoning.tags_of(model.tokenizer.chat_template, model.config.model.reasoning_parser)
        shown |= reasoning.shown_markers(model.tokenizer, tags)
    return shown


async def whole_reply(answer: Choices) -> Response:
    """Every choice read to its end, then one JSON reply (shaped and encoded off the event loop:
    choices of thousands of tokens with their top logprobs take seconds, during which no other
    request, nor /health, would be answered)."""
    n = len(answer.streams)
    texts, tokens = [""] * n, [0] * n
    generated: list[list[GeneratedToken]] = [[] for _ in range(n)]
    reasons: list[str | None] = [None] * n
    scored: list[tuple[PromptLogprob, ...] | None] = [None] * n
    async with contextlib.aclosing(collected(answer.streams)) as outputs:
        async for i, out in outputs:
            answer.count_thinking(i, out)
            text, shown = answer.shown(i, out)
            texts[i] += text
            tokens[i] = out.index
            generated[i] += shown
            reasons[i] = "length" if answer.hidden and out.finished else out.finish_reason
            scored[i] = scored[i] or out.prompt_logprobs

    def body() -> bytes:
        choices = []
        for i in range(n):
            echoed, echo_logprobs, extra = answer.prompt_part(i, scored[i])
            choice: dict = (
                {"index": i, "message": {"role": "assistant", "content": texts[i]}}
                if answer.chat
                else {"index": i, "text": echoed + texts[i]}
            )
            choice["logprobs"] = joined(echo_logprobs, answer.logprobs(i, generated[i]))
            choice["finish_reason"] = reasons[i]
            choices.append(choice | extra)
        for i, choice in enumerate(choices):
            thought, text = answer.thought(texts[i])
            if answer.thinks:  # vLLM's and llama.cpp's field
                choice["message"] |= {"content": text, "reasoning_content": thought}
            content, found = answer.split_calls(text)
            if found:
                choice["message"] |= {"content": content, "tool_calls": found}
                choice["finish_reason"] = "tool_calls"
        reply = {**answer.envelope(choices, False), "usage": answer.usage(sum(tokens))}
        return json.dumps(reply, ensure_ascii=False).encode()

    return Response(await asyncio.to_thread(body), media_type="application/json")


def joined(first: dict | None, then: dict | None) -> dict | None:
    """Completions logprobs of an echoed prompt followed by those of generated tokens."""
    if first is None or then is None:
        return first or then
    return {key: first[key] + then[key] for key in first}


def piece(
    answer: Choices,
    i: int,
    out: GenerationOutput | None,
    text: str = "",
    reason: str | None = None,
    prompt: tuple[str, dict | None, dict] = ("", None, {}),
    thought: str = "",
) -> dict:
    """Choice i's chunk of this output (None: the first chunk, with the role): `text`, and `reason`
    when it finishes; `prompt`: its prompt part (Choices.prompt_part), on its first chunk."""
    tokens = answer.shown(i, out)[1] if out else []
    echoed, echo_logprobs, extra = prompt
    shown = joined(echo_logprobs, answer.logprobs(i, tokens) if tokens else None)
    if answer.chat:
        delta = {"role": "assistant", "content": ""} if out is None else ({"content": text} if text else {})
        if thought:  # a reasoning model's thinking (vLLM's and llama.cpp's field)
            delta = {"reasoning_content": thought} | delta
        return {"index": i, "delta": delta, "logprobs": shown, "finish_reason": reason} | extra
    return {"index": i, "text": echoed + text, "logprobs": shown, "finish_reason": reason} | extra


async def stream_events(answer: Choices) -> AsyncIterator[str]:
    """The choices as SSE chunks: text as it comes (with its logprobs), tool calls whole at their
    choice's end, an error chunk for a choice that fails, usage if asked for, then [DONE]."""
    req, n = answer.req, len(answer.streams)
    tokens = [0] * n
    readers = [(answer.splitter(), answer.watcher()) for _ in range(n)]
    # choice i's prompt part (echo, prompt_logprobs) goes out with its first chunk
    pending = [answer.echo or req.prompt_logprobs is not None for _ in range(n)]
    if answer.chat:
        yield json.dumps(answer.envelope([piece(answer, i, None) for i in range(n)], True))
    async with contextlib.aclosing(merged(answer.streams)) as outputs:
        async for i, out in outputs:
            if out.error:
                yield json.dumps(error_body(out.error_status, out.error, "openai", code=out.error_status))
                break
            tokens[i] = out.index
            answer.count_thinking(i, out)
            reason = "length" if answer.hidden and out.finished else out.finish_reason
            thought, text, found = held(readers[i], out)  # calls go out whole at the end
            text = answer.shown(i, out)[0] if answer.hidden else text
            prompt: tuple[str, dict | None, dict] = ("", None, {})
            if pending[i]:  # its prompt's logprobs (thousands of entries) built and encoded off the loop
                pending[i], prompt = (
                    False,
                    await asyncio.to_thread(answer.prompt_part, i, out.prompt_logprobs),
                )
            if found:
                if text or thought or prompt != ("", None, {}):
                    chunk = piece(answer, i, out, text, prompt=prompt, thought=thought)
                    yield await encoded(answer.envelope([chunk], True), prompt)
                delta = {"tool_calls": [{"index": k, **call} for k, call in enumerate(found)]}
                chunk = {"index": i, "delta": delta, "logprobs": None, "finish_reason": None}
                yield json.dumps(answer.envelope([chunk], True), ensure_ascii=False)
                last = piece(answer, i, None, "", "tool_calls") | {"delta": {}}
                yield json.dumps(answer.envelope([last], True))
            elif (
                text
                or thought
                or out.finished
                or (answer.top is not None and out.tokens)
                or prompt != ("", None, {})
            ):
                chunk = piece(answer, i, out, text, reason, prompt, thought)
                yield await encoded(answer.envelope([chunk], True), prompt)
    if req.stream_options and req.stream_options.include_usage:
        yield json.dumps({**answer.envelope([], True), "usage": answer.usage(sum(tokens))})
    yield "[DONE]"


async def encoded(chunk: dict, prompt: tuple[str, dict | None, dict]) -> str:
    """A chunk as JSON: off the event loop where it carries a prompt part (megabytes of logprobs)."""
    if prompt == ("", None, {}):
        return json.dumps(chunk, ensure_ascii=False)
    return await asyncio.to_thread(json.dumps, chunk, ensure_ascii=False)


async def respond(http: Request, answer: Choices):
    if answer.req.stream:
        return EventSourceResponse(stream_events(answer))
    return await unless_disconnected(http, answer.streams, whole_reply(answer))


def serving(repository: ModelRepository, req: OpenAIRequest) -> LoadedModel:
    """The request's model, if it serves now and the request asks nothing it cannot honour."""
    model = repository.serving(req.model)
    problem = req.unsupported()
    if problem:
        raise ApiError(400, problem, code="unsupported_parameter")
    return model


def model_list(repository: ModelRepository) -> dict:
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
                **({"tasks": model.loaded.pooling.tasks} if model.loaded else {}),
                **({"reason": model.reason} if model.reason else {}),
            }
            for model in repository.models.values()
            for name in model.names
        ],
    }


async def completion(http: Request, repository: ModelRepository, req: CompletionRequest):
    model = serving(repository, req)
    # max_tokens 0 (with echo or prompt_logprobs): the prompt's one computation samples a token,
    # which is not shown
    length = (None if req.max_tokens is None else max(1, req.max_tokens), "max_tokens")
    parts: list[Choices] = []
    try:
        for given in req.prompts:
            prompt = (
                Prompt(given, param="prompt")
                if isinstance(given, str)
                else Prompt(ids=tuple(given), param="prompt")
            )
            parts.append(await admit_choices(http, model, req, prompt, length, chat=False))
    except BaseException:  # the prompts admitted before one was refused go too
        for part in parts:
            for stream in part.streams:
                await stream.aclose()
        raise
    first = parts[0]
    answer = Choices(
        req,
        model,
        first.prompt,
        [s for part in parts for s in part.streams],
        False,
        first.top,
        False,
        prompts=[p for part in parts for p in part.prompts],
        echoes=[
            given if isinstance(given, str) else model.tokenizer.decode(list(given))
            for given, part in zip(req.prompts, parts)
            for _ in part.streams
        ],
        hidden=req.max_tokens == 0,
        usage_prompt=sum(len(part.prompt) for part in parts),
    )
    return await respond(http, answer)


def chat_text(model: LoadedModel, req: ChatCompletionRequest) -> Prompt:
    """The conversation as the chat template takes it: its messages (and tools)."""
    takes_tools = model.tokenizer.template_takes_tools
    messages = tool_calls.template_messages(req, takes_tools)
    tools = tool_calls.template_tools(req) if takes_tools else None
    return Prompt(messages=messages, tools=tools, template_kwargs=req.chat_template_kwargs, param="messages")


async def admit_chat(
    http: Request,
    repository: ModelRepository,
    req: ChatCompletionRequest,
    length_param: str | None = None,
    style: ApiStyle = OPENAI,
    thinking_param: str = "max_thinking_tokens",
) -> Choices:
    """A chat request admitted: what /v1/chat/completions serves, and the APIs that translate into
    it (OpenAI's Responses, Anthropic's Messages: `length_param` and `thinking_param`, how they
    name max_tokens and the thinking budget, and `style`, their errors')."""
    model = serving(repository, req)
    asked, param = (
        (req.max_completion_tokens, "max_completion_tokens")
        if req.max_completion_tokens
        else (req.max_tokens, "max_tokens")
    )
    length = (asked, length_param or param)
    return await admit_choices(http, model, req, chat_text(model, req), length, True, style, thinking_param)


async def chat_completion(http: Request, repository: ModelRepository, req: ChatCompletionRequest):
    return await respond(http, await admit_chat(http, repository, req))


def translated_chat(fields: dict, names: Mapping[str, str]) -> ChatCompletionRequest:
    """The chat request another API's request translates into; a field it refuses is a 400 named
    as the other API names it (`names`: chat field -> its name there)."""
    try:
        return ChatCompletionRequest.model_validate({k: v for k, v in fields.items() if v is not None})
    except ValidationError as exc:
        problem = exc.errors()[0]
        where = [str(p) for p in problem["loc"]]
        field_name = names.get(where[0], where[0]) if where else "body"
        shown = ".".join([field_name, *where[1:]])
        raise ApiError(400, f"{shown}: {problem['msg']}", param=field_name) from None


def openai_router(repository: ModelRepository) -> APIRouter:
    router = APIRouter(prefix="/v1", dependencies=[declares(OPENAI)])
    completion_request, chat_request = json_body(CompletionRequest), json_body(ChatCompletionRequest)

    @router.get("/models")
    async def models():
        return model_list(repository)

    @router.post("/completions")
    async def completions(http: Request, req: CompletionRequest = Depends(completion_request)):
        return await completion(http, repository, req)

    @router.post("/chat/completions")
    async def chat_completions(http: Request, req: ChatCompletionRequest = Depends(chat_request)):
        return await chat_completion(http, repository, req)

    return router
