"""The MindSpore llm-serving API, byte-compatible with its clients:

    POST /models/{model}                  stream or not, per the body's "stream"
    POST /models/{model}/generate         one line {"generated_text": ...}
    POST /models/{model}/generate_stream  SSE (return_protocol "sse") or `data:` lines
    GET  /serving/get_bs[?model=M][&group=N]      one SSE event: running batch size (of one model,
                                                  of one of its groups; without model: every model's)
    GET  /serving/get_request_numbers[?model=M]   one SSE event: waiting requests

An SSE event's data is the JSON {"event": "message", "retry": 30000, "data": ...}, as upstream sends it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response, StreamingResponse
from sse_starlette.sse import EventSourceResponse

from server.access import client_of
from server.admission import Admission, Prompt, admit_answers
from server.client_disconnect import unless_disconnected
from server.collect import whole_answer
from server.errors import NATIVE, ApiError, declares
from server.logprob_format import LogprobFormatter
from server.model_repository import ModelRepository
from server.native_schema import ClientRequest, TgiGrammar
from server.openai_schema import json_text
from server.output import AnswerStream, GeneratedToken, GenerationOutput
from server.request_body import json_body
from server.structured_output import GrammarError, GrammarSpec


def sse_message(data) -> str:
    return json.dumps({"event": "message", "retry": 30000, "data": data}, ensure_ascii=False)


def tgi_details(
    outs: list[GenerationOutput],
    seed: int | None,
    formatter: LogprobFormatter,
    prompt: list[int] | None = None,
) -> dict:
    """TGI's `details` of a finished answer: why it ended, its tokens with their logprobs, and with
    decoder_input_details (`prompt`: its ids) the prompt's tokens with theirs."""
    last = outs[-1]
    scored = next((list(o.prompt_logprobs) for o in outs if o.prompt_logprobs is not None), [])
    reason = {"length": "length", "stop": "stop_sequence" if last.stop_string else "eos_token"}
    tokens = [t for out in outs for t in out.tokens]
    return {
        "finish_reason": reason.get(last.finish_reason or "", last.finish_reason),
        "generated_tokens": last.index,
        "seed": seed,
        "prefill": [] if prompt is None else formatter.tgi_prefill(prompt, scored),
        "tokens": [formatter.tgi(t.id, None if t.logprob is None else t.logprob.logprob) for t in tokens],
        "top_tokens": [formatter.tgi_top(t.logprob) for t in tokens],
    }


async def respond_full(
    http: Request,
    answer: AnswerStream,
    request: ClientRequest,
    formatter: LogprobFormatter,
    prompt: list[int] | None = None,
) -> Response:
    done = await unless_disconnected(http, [answer], whole_answer(answer))
    if isinstance(done, Response):  # the client is gone
        return done
    text, outs = done

    def body() -> bytes:
        reply: dict = {"generated_text": text}
        if request.parameters.details:
            shown = prompt if request.parameters.decoder_input_details else None
            reply["details"] = tgi_details(outs, request.parameters.seed, formatter, shown)
        return (json.dumps(reply, ensure_ascii=False) + "\n").encode()

    # Off the event loop: details of thousands of tokens take long to shape and encode.
    return Response(await asyncio.to_thread(body), media_type="application/json")


async def stream_pieces(
    answer, return_full_text: bool, piece, error, full, every_token: bool = False
) -> AsyncIterator:
    """The answer's pieces in one protocol's framing: piece(output, index), error(message),
    full(text). `every_token`: one piece per token of the answer (the EOS that ends it is none),
    indexed by token, its text empty while a character is incomplete or the token is special (as
    TGI streams); else one per piece of text.
    An error is the stream's last event: the full text would read as a finished answer."""
    text = []
    async with contextlib.aclosing(answer):
        async for out in answer:
            if out.text or (every_token and out.tokens):
                text.append(out.text)
                yield piece(out, out.index - 1 if every_token else len(text) - 1)
            if out.error:
                yield error(out.error)
                return
    if return_full_text:
        yield full("".join(text))


def data_line(payload: dict) -> bytes:
    return ("data:" + json.dumps(payload, ensure_ascii=False) + "\n").encode()


def sse_events(answer, return_full_text: bool) -> AsyncIterator[str]:
    return stream_pieces(
        answer,
        return_full_text,
        lambda out, _i: sse_message(out.text),
        lambda message: json.dumps({"event": "error", "retry": 30000, "data": message}),
        sse_message,
    )


def plain_token(text: str, index: int, token: GeneratedToken | None, formatter: LogprobFormatter) -> dict:
    """A plain-protocol line's token: its text and index, with its id, logprob (null unless details
    were asked for) and special flag, and TGI's top_tokens with top_n_tokens."""
    line: dict = {"token": {"text": text, "index": index}}
    if token is not None:
        tgi = formatter.tgi(token.id, None if token.logprob is None else token.logprob.logprob)
        line["token"] |= {"id": tgi["id"], "logprob": tgi["logprob"], "special": tgi["special"]}
        if token.logprob is not None and token.logprob.top:
            line["top_tokens"] = formatter.tgi_top(token.logprob)
    return line


def plain_lines(out: GenerationOutput, first: int, formatter: LogprobFormatter) -> bytes:
    """A line per new token of the output, indexed from `first` (the answer's tokens before it). A
    step that kept proposed tokens (speculation) brings several at once: each gets its own line, the
    output's text on the last (the text those tokens completed), the others empty, as TGI streams a
    token whose text is not yet complete. Text with no new token (held back until the end): a line
    of its own, indexed as the next token would be."""
    if not out.tokens:
        return data_line(plain_token(out.text, first, None, formatter))
    last = len(out.tokens) - 1
    return b"".join(
        data_line(plain_token(out.text if n == last else "", first + n, token, formatter))
        for n, token in enumerate(out.tokens)
    )


def data_lines(answer, return_full_text: bool, formatter: LogprobFormatter) -> AsyncIterator[bytes]:
    shown = 0  # the answer's tokens streamed so far (an EOS that ends it is none)

    def lines(out: GenerationOutput, _index: int) -> bytes:
        nonlocal shown
        first, shown = shown, shown + len(out.tokens)
        return plain_lines(out, first, formatter)

    return stream_pieces(
        answer,
        return_full_text,
        lines,
        lambda message: data_line({"error": message}),
        lambda text: data_line({"generated_text": text}),
        every_token=True,
    )


def respond_stream(answer, request: ClientRequest, formatter: LogprobFormatter):
    p = request.parameters
    if p.return_protocol == "sse":
        return EventSourceResponse(sse_events(answer, p.return_full_text))
    return StreamingResponse(data_lines(answer, p.return_full_text, formatter), media_type="text/plain")


async def one_event(value: int):
    yield sse_message(value)


def tgi_grammar(grammar: TgiGrammar | None) -> GrammarSpec | None:
    if grammar is None:
        return None
    if grammar.type == "regex":
        if not isinstance(grammar.value, str):
            raise GrammarError("a regex grammar's value is the regex, a string")
        return GrammarSpec("regex", grammar.value)
    return GrammarSpec("json", json_text(grammar.value))


def native_router(repository: ModelRepository) -> APIRouter:
    router = APIRouter(dependencies=[declares(NATIVE)])
    client_request = json_body(ClientRequest)

    async def start(
        http: Request, name: str, request: ClientRequest, whole: bool
    ) -> tuple[AnswerStream, LogprobFormatter, list[int]]:
        """The request admitted, with its prompt's ids; `whole`: its answer is built in memory (not
        streamed)."""
        model = repository.serving(name)
        p = request.parameters
        if p.decoder_input_details and not whole:  # as TGI: shown in a whole reply's details only
            raise ApiError(
                NATIVE.bad_parameter,
                "decoder_input_details is not supported when streaming tokens",
                param="parameters.decoder_input_details",
            )
        chat = model.config.server.apply_chat_template if p.chat_template is None else p.chat_template
        messages = [{"role": "user", "content": request.inputs}] if chat else None
        admission = Admission(
            prompt=Prompt(request.inputs, messages, truncate=p.truncate),
            sampling=p,
            do_sample=p.do_sample,
            seeds=(p.seed,),
            max_tokens=p.max_new_tokens,
            max_tokens_param="max_new_tokens",
            # the upstream default (300) still just ends early
            length_checked="max_new_tokens" in p.model_fields_set,
            sampling_fields={"logprobs": p.logprobs_asked(), "prompt_logprobs": p.prompt_logprobs_asked()},
            stop=tuple(p.stop),
            ignore_eos=p.ignore_eos,
            grammar=lambda: tgi_grammar(p.grammar),
            grammar_param="parameters.grammar",
            whole=whole,
            cache_salt=p.cache_salt,
            client=client_of(http.scope),
            priority=p.priority,
            speculate=p.speculate,
        )
        admitted = await admit_answers(model, NATIVE, admission)
        return admitted.streams[0], model.formatter, admitted.prompt

    @router.post("/models/{model}")
    async def generate_any(http: Request, model: str, request: ClientRequest = Depends(client_request)):
        answer, formatter, prompt = await start(http, model, request, whole=not request.stream)
        if request.stream:
            return respond_stream(answer, request, formatter)
        return await respond_full(http, answer, request, formatter, prompt)

    @router.post("/models/{model}/generate")
    async def generate(http: Request, model: str, request: ClientRequest = Depends(client_request)):
        answer, formatter, prompt = await start(http, model, request, whole=True)
        return await respond_full(http, answer, request, formatter, prompt)

    @router.post("/models/{model}/generate_stream")
    async def generate_stream(http: Request, model: str, request: ClientRequest = Depends(client_request)):
        answer, formatter, _ = await start(http, model, request, whole=False)
        return respond_stream(answer, request, formatter)

    @router.get("/serving/get_bs")
    async def get_bs(group: int | None = None, model: str | None = None):
        """?model=M: one model's batch (without: every model's); &group=N: that replica's (group N
        is the agent of port N in the model's agents.ports)."""
        engines = repository.engines(model)
        if group is None:
            return EventSourceResponse(one_event(sum(e.stats().running for e in engines)))
        if model is None and len(repository.models) > 1:
            raise ApiError(400, "group needs model=NAME: groups are a model's (several models are served)")
        groups = len(repository.resolve(model).config.agents.groups)
        if not 0 <= group < groups:
            raise ApiError(400, f"group {group} does not exist (groups: 0..{groups - 1})")
        return EventSourceResponse(one_event(sum(e.stats().groups[group].running for e in engines)))

    @router.get("/serving/get_request_numbers")
    async def get_request_numbers(model: str | None = None):
        """?model=M: one model's waiting requests (without: every model's)."""
        return EventSourceResponse(one_event(sum(e.stats().waiting for e in repository.engines(model))))

    return router
