"""Request assembly, the steps of the one admission path (server/admission.py): the prompt's
tokens (off the event loop), the sampling parameters of a request (validated once, here), the
checks of what it asks, its admission into the engine as EngineRequests (a refusal becomes an
ApiError), and the wait for a whole answer that ends when the client goes."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import Awaitable, Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TypeVar

import numpy as np
from fastapi import Request
from fastapi.responses import Response
from pydantic import BaseModel

from agent.contract.sampling import SamplingParams
from agent.model.chat_template import RenderBudgetError
from agent.model.tokenizer import TextTokenizer, TokenizerError
from scheduler.engine import Engine
from scheduler.engine_io import AdmissionError, EngineRequest, TokenConstraint
from server.engine_client import EngineClient
from server.errors import ApiError, ApiStyle, refusal_status
from server.output import AnswerStream
from server.structured_output import Grammar, GrammarError, Grammars, GrammarSpec
from server.thinking_budget import ThinkingBudget
from server.tracing import current_request

T = TypeVar("T")
# Prompts up to this many characters are tokenized on the event loop (well under a millisecond);
# longer ones in a small pool, where a flood of big prompts queues instead of stalling every stream.
INLINE_PROMPT_CHARS = 4096
TOKENIZER_THREADS = 2
CLIENT_GONE = 499  # nginx's "client closed request": nobody reads it; the access log shows it

# The fields both APIs' requests name as SamplingParams does and mean alike; the others are per API.
SAMPLING_FIELDS = set(SamplingParams.model_fields) - {
    "do_sample",
    "seed",
    "logprobs",
    "logit_bias",
    "prompt_logprobs",
}


def check_vocabulary(ids: Iterable[int], vocab_size: int, param: str) -> None:
    """Token ids a request names lie in the vocabulary: else 400 naming the parameter (the one
    place the server checks it; the agent checks its wire input itself)."""
    outside = next((t for t in ids if not 0 <= t < vocab_size), None)
    if outside is not None:
        raise ApiError(
            400,
            f"{param}: token id {outside} is outside the vocabulary (0..{vocab_size - 1})",
            param=param,
        )


def sampling_params(
    request: BaseModel, do_sample: bool, seed: int | None, vocab_size: int, **fields
) -> SamplingParams:
    """The request's sampling fields (those it has; the rest keep SamplingParams' defaults, or
    `fields`), validated here once, where the request enters; a token id past the vocabulary is
    a 400 naming the parameter."""
    sampling = SamplingParams(
        do_sample=do_sample, seed=seed, **request.model_dump(include=SAMPLING_FIELDS), **fields
    )
    check_vocabulary(sampling.stop_token_ids, vocab_size, "stop_token_ids")
    check_vocabulary((t for t, _ in sampling.logit_bias), vocab_size, "logit_bias")
    return sampling


async def compile_grammar(
    grammars: Grammars, spec_of: Callable[[], GrammarSpec | None], param: str, status: int
) -> Grammar | None:
    """The request's grammar (`spec_of()`) compiled (cached), or None; a bad one is `status`
    naming `param`."""
    try:
        spec = spec_of()
        return None if spec is None else await grammars.compile(spec)
    except GrammarError as exc:
        raise ApiError(status, f"{param}: the grammar does not compile: {exc}", param=param) from exc


def check_answer_fits(
    prompt_len: int, max_new_tokens: int, context: int, style: ApiStyle, param: str
) -> None:
    """An explicit answer length that can never fit is refused, naming the limit (in the API's
    style: TGI answers 422, vLLM 400), instead of a silently shortened answer."""
    if prompt_len + max_new_tokens > context:
        raise ApiError(
            style.bad_parameter,
            f"the prompt ({prompt_len} tokens) + {param} ({max_new_tokens}) exceeds the "
            f"context of {context} tokens: ask for at most {max(0, context - prompt_len)}",
            param=param,
        )


def check_reply_size(
    choices: int, answer_tokens: int, top: int | None, prompt_tokens: int, prompt_top: int | None, limit: int
) -> None:
    """A reply's logprob entries are bounded (server.max_reply_logprobs), refused with 400 before
    any work: each choice's prompt part (echo's logprobs, prompt_logprobs: prompt tokens x (1 + k),
    built whole even in a stream) and, in a reply built whole, its answer's (answer_tokens x (1 +
    top_logprobs); 0 answer tokens for a stream, which sends them as they come)."""
    answer = answer_tokens * (1 + top) if top is not None else 0
    prompt = prompt_tokens * (1 + prompt_top) if prompt_top is not None else 0
    entries = choices * (answer + prompt)
    if entries <= limit:
        return
    parts = []
    if answer:
        parts.append(f"{answer_tokens} answer tokens x {1 + (top or 0)} logprobs")
    if prompt:
        parts.append(f"{prompt_tokens} prompt tokens x {1 + (prompt_top or 0)} logprobs")
    raise ApiError(
        400,
        f"a reply of {choices} choice(s) x ({' + '.join(parts)}) = {entries} logprob entries exceeds "
        f"server.max_reply_logprobs ({limit}): ask for fewer (n, max_tokens, top_logprobs, "
        "prompt_logprobs, a shorter prompt){'' if prompt else ' or stream the answer'}",
        param="prompt_logprobs" if prompt >= answer else "top_logprobs",
    )


def check_first_token(grammar: Grammar, sampling: SamplingParams, eos_ids: frozenset[int]) -> None:
    """A grammar whose first tokens are all kept out by min_tokens (EOS and stop_token_ids may not
    come before it) leaves nothing to sample: 400 now, not an error after admission. (A later
    token of the grammar may still leave nothing: that sequence then ends with an error.)"""
    if sampling.min_tokens == 0:
        return
    forbidden = eos_ids | frozenset(sampling.stop_token_ids)
    if np.isin(grammar.first, list(forbidden)).all():
        raise ApiError(
            400,
            "the grammar's first token can only be EOS or one of stop_token_ids, which min_tokens "
            f"({sampling.min_tokens}) keeps out: no answer can be generated",
            param="min_tokens",
        )


@dataclass(frozen=True)
class AnswerRequest:
    """What one request asks of a model's engine: a prompt, one sampling per answer (OpenAI's `n`
    choices), the answers' length, stops and grammar, and who asks (access.client_of), with what
    priority and prefix-cache salt (scheduler/client_share.py, scheduler/block_manager.py)."""

    prompt: list[int]
    samplings: list[SamplingParams]
    max_new_tokens: int
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    grammar: Grammar | None = None
    cache_salt: str | None = None
    client: str = ""
    priority: int = 0
    speculate: bool = True  # its tokens may be proposed (runtime.speculation): false opts out
    thinking: ThinkingBudget | None = None  # a reasoning model's thinking budget (server/thinking_budget.py)
    shown: frozenset[int] = frozenset()  # special tokens the answer's text keeps (a tool format's markers)


def generate_answer(
    client: EngineClient, request: AnswerRequest, sampling: SamplingParams, request_id: str | None = None
) -> AnswerStream:
    """One answer of the request, queued at once (AdmissionError if refused) with its stream;
    closing the stream early (the client is gone) aborts it and frees its slot."""
    trace = current_request()  # tracing on: the answer's spans go under its request's
    engine_request = EngineRequest(
        request_id or uuid.uuid4().hex,
        tuple(request.prompt),
        sampling,
        request.max_new_tokens,
        request.ignore_eos,
        _constraint(request),
        request.cache_salt,
        request.client,
        request.priority,
        request.speculate,
        trace,
    )
    stream = client.generate(engine_request, request.stop, request.shown)
    if trace is not None:
        trace.admitted(client.engine.config.model.name, engine_request)
    return stream


def _constraint(request: AnswerRequest) -> TokenConstraint | None:
    """One answer's constraint: its grammar, its thinking budget, or both composed."""
    grammar = None if request.grammar is None else request.grammar.follow()
    return grammar if request.thinking is None else request.thinking.follow(grammar)


async def admit(client: EngineClient, request: AnswerRequest, style: ApiStyle) -> list[AnswerStream]:
    """One answer stream per sampling, all admitted or none (a refusal becomes an ApiError)."""
    if request.priority and client.engine.config.scheduler.scheduling_policy != "priority":
        raise ApiError(
            400,
            "priority needs scheduler.scheduling_policy: priority (this server is first come, first served)",
            param="priority",
        )
    if request.grammar is not None:
        # once per distinct min_tokens and stop ids (n choices differ only in their seeds)
        distinct = {(s.min_tokens, tuple(s.stop_token_ids)): s for s in request.samplings}
        for sampling in distinct.values():
            check_first_token(request.grammar, sampling, client.stop_ids)
    streams = []
    try:
        for sampling in request.samplings:
            streams.append(generate_answer(client, request, sampling))
    except AdmissionError as exc:
        for stream in streams:  # admitted choices of a refused request go too
            await stream.aclose()
        raise ApiError(refusal_status(exc.reason, style), str(exc)) from exc
    return streams


class PromptEncoder:
    """Prompt text -> token ids without stalling the event loop. A prompt of more characters than
    the longest accepted prompt's tokens could hold (each at most the vocabulary's longest token)
    is refused (413) before any work; a long one is tokenized in a small thread pool, and every
    conversation is rendered there (the chat template's cost is the model file's, not the
    request's: chat_template.RenderBudget bounds it). The token bound follows in `admit`."""

    def __init__(self, tokenizer: TextTokenizer, engine: Engine):
        self.tokenizer, self.engine = tokenizer, engine
        vocabulary = tokenizer.tokenizer.get_vocab(with_added_tokens=True)
        # A byte-level token's string has one character per byte: never fewer than its text's.
        self.longest_token_chars = max(map(len, vocabulary), default=1)
        self.template_chars: int | None = None  # measured by the first chat, off the event loop
        self.pool = ThreadPoolExecutor(TOKENIZER_THREADS, thread_name_prefix="tokenize")

    async def encode(
        self, text: str, bounded: bool = True, param: str | None = None, add_special_tokens: bool = True
    ) -> list[int]:
        """bounded=False: the prompt is cut to its last tokens afterwards (the native `truncate`),
        so any length may fit."""
        return await self._off_loop(len(text), bounded, param, lambda: self._ids(text, add_special_tokens))

    async def encode_chat(
        self,
        messages: list[dict],
        bounded: bool = True,
        param: str | None = None,
        tools: list[dict] | None = None,
        template_kwargs: dict | None = None,
    ) -> list[int]:
        """`tools`: for a template that renders them (tokenizer.template_takes_tools);
        `template_kwargs`: more template variables (a request's chat_template_kwargs)."""

        most_chars = self._most_chars() if bounded else None

        def render() -> list[int]:  # the template writes BOS itself where the model wants one
            text = self.tokenizer.apply_chat_template(
                messages, tools=tools, kwargs=template_kwargs, max_chars=most_chars
            )
            return self._ids(text, False)

        if bounded:
            self._check_messages(len(messages))
        # What the render writes at least: every message's fields (empty ones too: each costs the
        # template's own text), the tools and the variables.
        if self.template_chars is None:  # two renders of the model's template: in the pool
            measured = await asyncio.get_running_loop().run_in_executor(
                self.pool, template_chars_per_message, self.tokenizer
            )
            self.template_chars = measured
        chars = sum(map(message_chars, messages)) + len(messages) * self.template_chars
        chars += (len(json.dumps(tools)) if tools else 0) + (
            len(json.dumps(template_kwargs)) if template_kwargs else 0
        )
        try:
            return await self._off_loop(chars, bounded, param, render, inline=False)
        except RenderBudgetError as exc:
            if exc.output:
                raise ApiError(413, f"the chat template renders this conversation too long: {exc}") from exc
            raise ApiError(
                500,
                f"the model's chat template exceeded its render budget ({exc}): the template in the model's "
                "files needs fixing or replacing (a GGUF's tokenizer.chat_template, tokenizer_config.json's)",
            ) from exc

    async def _off_loop(
        self,
        chars: int,
        bounded: bool,
        param: str | None,
        tokenize: Callable[[], list[int]],
        inline: bool = True,
    ) -> list[int]:
        if bounded:
            self._check_chars(chars)
        try:
            if inline and chars <= INLINE_PROMPT_CHARS:
                return tokenize()
            return await asyncio.get_running_loop().run_in_executor(self.pool, tokenize)
        except TokenizerError as exc:
            raise ApiError(400, str(exc), param=param) from exc

    def _ids(self, text: str, add_special_tokens: bool) -> list[int]:
        # encode_batch runs without the GIL (encode holds it: 1 s for 900 000 characters, during
        # which the event loop would stand still).
        return self.tokenizer.tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def _most_tokens(self) -> int | None:
        """The longest prompt any agent group accepts (None: not connected yet, and admission
        refuses the request then)."""
        return self.engine.stats().max_prompt_len

    def _most_chars(self) -> int | None:
        most_tokens = self._most_tokens()
        return None if most_tokens is None else most_tokens * self.longest_token_chars

    def _check_chars(self, chars: int) -> None:
        most_tokens, most_chars = self._most_tokens(), self._most_chars()
        if most_chars is not None and chars > most_chars:
            raise ApiError(
                413,
                f"the prompt has {chars} characters; the longest accepted is {most_tokens} tokens, "
                f"which never hold more than {most_chars} characters",
            )

    def _check_messages(self, count: int) -> None:
        """A conversation of more messages than the longest prompt has tokens (each message writes
        at least its template's markers) is refused before it is rendered."""
        most_tokens = self._most_tokens()
        if most_tokens is not None and count > most_tokens:
            raise ApiError(
                413,
                f"the conversation has {count} messages; the longest accepted prompt is {most_tokens} "
                "tokens, and each message takes at least one",
                param="messages",
            )


def message_chars(message: dict) -> int:
    """The characters a message's fields hold (its content, role, name, tool calls, reasoning ...),
    which its render writes at least."""
    return sum(
        len(v) if isinstance(v, str) else len(json.dumps(v)) for v in message.values() if v is not None
    )


def template_chars_per_message(tokenizer: TextTokenizer) -> int:
    """The characters the chat template writes around each message besides its fields (ChatML's
    `<|im_start|>user\n...<|im_end|>\n`: 23), measured once from two empty turns; at least 1."""
    turn = [{"role": "user", "content": ""}, {"role": "assistant", "content": ""}]
    try:
        one = tokenizer.apply_chat_template(turn[:1], add_generation_prompt=False)
        three = tokenizer.apply_chat_template([*turn, turn[0]], add_generation_prompt=False)
    except (TokenizerError, RenderBudgetError):
        return 1  # no template, or one that refuses empty turns: count the fields alone
    return max(1, (len(three) - len(one)) // 2)


async def unless_disconnected(
    request: Request, streams: list[AnswerStream], work: Awaitable[T]
) -> T | Response:
    """The result of `work` (which reads `streams` to their end), unless the client disconnects
    first: then `work` is cancelled and the streams closed, which aborts their requests and frees
    their slots. (Streaming responses watch for the disconnect themselves.)"""
    working = asyncio.ensure_future(work)
    watching = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait((working, watching), return_when=asyncio.FIRST_COMPLETED)
    finally:
        watching.cancel()
        if not working.done():
            working.cancel()
            await asyncio.gather(working, return_exceptions=True)
        for stream in streams:  # work cancelled before its first step never opened them
            await stream.aclose()
    if working.cancelled():
        return Response(status_code=CLIENT_GONE)
    return working.result()


async def _disconnected(request: Request) -> None:
    """Returns when the client disconnects (the body was read: nothing else arrives before)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
