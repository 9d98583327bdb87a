"""One admission path for every API. A front end (native, OpenAI completions and chat, Responses,
Anthropic, Triton over HTTP and gRPC) translates its body into an Admission and calls
`admit_answers`; what follows is the same for all: the prompt's tokens (a chat template where it
asks for one), the answer length, one validated SamplingParams per answer, the grammar, the reply
bound, and the engine's admission. Errors come in the API's style (server/errors.py ApiStyle).

    admitted = await admit_answers(model, OPENAI, Admission(prompt=Prompt(text="Hi", param="prompt"), ...))
    async for i, out in collected(admitted.streams): ...          # server/collect.py
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import numpy as np
from pydantic import BaseModel

from agent.contract.sampling import SamplingParams
from scheduler.engine_io import AdmissionError, EngineRequest, TokenConstraint
from server import reasoning
from server.access import KEY_CLIENT
from server.engine_client import EngineClient
from server.errors import ApiError, ApiStyle, refusal_status
from server.model_repository import LoadedModel
from server.output import AnswerStream
from server.prompt_encoder import PromptEncoder
from server.structured_output import Grammar, GrammarError, Grammars, GrammarSpec
from server.thinking_budget import ThinkingBudget
from server.tracing import current_request

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


@dataclass(frozen=True, kw_only=True)
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
        request_id=request_id or uuid.uuid4().hex,
        prompt=tuple(request.prompt),
        sampling=sampling,
        max_new_tokens=request.max_new_tokens,
        ignore_eos=request.ignore_eos,
        constraint=_constraint(request),
        cache_salt=request.cache_salt,
        client=request.client,
        priority=request.priority,
        speculate=request.speculate,
        trace=trace,
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


@dataclass(frozen=True)
class Prompt:
    """A request's prompt: plain text, or a conversation rendered by the model's chat template."""

    text: str = ""
    messages: list[dict] | None = None  # a conversation (then `text` is unused)
    tools: list[dict] | None = None  # for a template that renders them
    template_kwargs: dict | None = None  # more template variables (chat_template_kwargs)
    param: str | None = None  # how the API names it (its errors name it)
    truncate: int | None = None  # keep its last tokens (the native `truncate`): any length fits
    ids: tuple[int, ...] | None = None  # token ids given as they are (then `text` is unused)


@dataclass(frozen=True, kw_only=True)
class Admission:
    """What an API's body asks, in the API's own words where an error names them. `sampling`: the
    body whose sampling fields apply (SAMPLING_FIELDS), with `sampling_fields` besides
    (logprobs, logit_bias); one answer per seed (OpenAI's n choices). `max_tokens` None: up to
    the context; `length_checked` False: a default that may just end early instead of being
    refused (the native 300). `whole`: the reply is built in memory, its logprobs bounded."""

    prompt: Prompt
    sampling: BaseModel
    do_sample: bool
    seeds: tuple[int | None, ...]
    max_tokens: int | None
    max_tokens_param: str
    length_checked: bool = True
    sampling_fields: dict = field(default_factory=dict)
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    grammar: Callable[[], GrammarSpec | None] = lambda: None
    grammar_param: str = ""
    whole: bool = True
    cache_salt: str | None = None
    client: str = ""
    priority: int = 0
    speculate: bool = True
    thinking_budget: int | None = None  # a reasoning model's thinking tokens at most (thinking_budget.py)
    thinking_param: str = "max_thinking_tokens"
    shown_tokens: frozenset[int] = frozenset()  # special tokens its answers' text keeps


@dataclass(frozen=True)
class Admitted:
    prompt: list[int]
    max_tokens: int
    streams: list[AnswerStream]  # one per answer, in the order of the seeds


async def prompt_tokens(encoder: PromptEncoder, prompt: Prompt) -> list[int]:
    bounded = prompt.truncate is None
    if prompt.ids is not None:  # their vocabulary is checked in admit_answers; their length by the engine
        return list(prompt.ids)
    if prompt.messages is not None:
        ids = await encoder.encode_chat(
            prompt.messages, bounded, prompt.param, prompt.tools, prompt.template_kwargs
        )
    else:
        ids = await encoder.encode(prompt.text, bounded, prompt.param)
    return ids if prompt.truncate is None else ids[-prompt.truncate :]


async def admit_answers(model: LoadedModel, style: ApiStyle, admission: Admission) -> Admitted:
    """The request's answers admitted on the model, all or none (ApiError in `style` otherwise)."""
    a = admission
    if not model.pooling.generates and a.sampling_fields.get("pool") is None:
        raise ApiError(
            400,
            f"model {model.name!r} is a pooling model (its file declares {model.pooling.kind} pooling): it "
            f"serves {', '.join(model.pooling.tasks)} (/v1/embeddings, /score, /rerank), not text",
            param="model",
            code="model_not_supported",
        )
    prompt = await prompt_tokens(model.encoder, a.prompt)
    if a.prompt.ids is not None:
        check_vocabulary(prompt, model.tokenizer.vocab_size, a.prompt.param or "prompt")
    max_tokens = model.engine.max_seq_len if a.max_tokens is None else a.max_tokens
    if a.max_tokens is not None and a.length_checked:
        check_answer_fits(len(prompt), max_tokens, model.engine.max_seq_len, style, a.max_tokens_param)
    vocab_size = model.tokenizer.vocab_size
    samplings = [
        sampling_params(a.sampling, a.do_sample, seed, vocab_size, **a.sampling_fields) for seed in a.seeds
    ]
    grammar = await compile_grammar(model.grammars, a.grammar, a.grammar_param, style.bad_parameter)
    thinking = None if a.thinking_budget is None else thinking_of(model, a, prompt, max_tokens)
    first = samplings[0]
    check_reply_size(
        len(samplings),
        max_tokens if a.whole else 0,
        first.logprobs,
        len(prompt),
        first.prompt_logprobs,
        model.config.server.max_reply_logprobs,
    )
    request = AnswerRequest(
        prompt=prompt,
        samplings=samplings,
        max_new_tokens=max_tokens,
        stop=a.stop,
        ignore_eos=a.ignore_eos,
        grammar=grammar,
        cache_salt=tenant_salt(a.client, a.cache_salt, model.config.server.prefix_cache_per_key),
        client=a.client,
        priority=a.priority,
        speculate=a.speculate,
        thinking=thinking,
        shown=a.shown_tokens,
    )
    streams = await admit(model.client, request, style)
    return Admitted(prompt, max_tokens, streams)


def tenant_salt(client: str, cache_salt: str | None, per_key: bool) -> str | None:
    """The prefix-cache salt a request's blocks chain from: with keys on (the client a verified
    key, server/access.py ApiKeys.client) and server.prefix_cache_per_key, the key's identity and
    the request's own salt, so that no key learns from its time to first token what another sent;
    else the request's salt alone (a client's address is no tenant: it shares the common cache)."""
    if not (per_key and client.startswith(KEY_CLIENT)):
        return cache_salt
    return client if cache_salt is None else f"{client}\n{cache_salt}"


def thinking_of(model: LoadedModel, a: Admission, prompt: list[int], max_tokens: int) -> ThinkingBudget:
    """The request's thinking budget on the model: only a model that reasons has one (elsewhere the
    field is a 400 naming it, rather than ignored: the client asked for a bound it would not get),
    and it is at most the answer's length."""
    budget, param = a.thinking_budget, a.thinking_param
    assert budget is not None
    found = reasoning.of_answers(model.tokenizer, model.config.model.reasoning_parser, prompt)
    if found is None:
        raise ApiError(400, f"{param}: this model does not reason (model.reasoning_parser)", param=param)
    if budget > max_tokens:
        raise ApiError(
            400,
            f"{param}: {budget} is more than the answer's length ({a.max_tokens_param} {max_tokens})",
            param=param,
        )
    return ThinkingBudget.of(model.tokenizer, budget, found.inside, found.tags)
