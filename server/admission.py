"""One admission path for every API. A front end (native, OpenAI completions and chat, Responses,
Anthropic, Triton over HTTP and gRPC) translates its body into an Admission and calls
`admit_answers`; what follows is the same for all: the prompt's tokens (a chat template where it
asks for one), the answer length, one validated SamplingParams per answer, the grammar, the reply
bound, and the engine's admission. Errors come in the API's style (server/errors.py ApiStyle).

    admitted = await admit_answers(model, OPENAI, Admission(Prompt(text="Hi", param="prompt"), ...))
    async for i, out in collected(admitted.streams): ...          # server/collect.py
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from pydantic import BaseModel

from server import reasoning
from server.access import KEY_CLIENT
from server.assembly import (
    AnswerRequest,
    PromptEncoder,
    admit,
    check_answer_fits,
    check_reply_size,
    check_vocabulary,
    compile_grammar,
    sampling_params,
)
from server.errors import ApiError, ApiStyle
from server.model_repository import LoadedModel
from server.output import AnswerStream
from server.structured_output import GrammarSpec
from server.thinking_budget import ThinkingBudget


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


@dataclass(frozen=True)
class Admission:
    """What an API's body asks, in the API's own words where an error names them. `sampling`: the
    body whose sampling fields apply (assembly.SAMPLING_FIELDS), with `sampling_fields` besides
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
        prompt,
        samplings,
        max_tokens,
        a.stop,
        a.ignore_eos,
        grammar,
        tenant_salt(a.client, a.cache_salt, model.config.server.prefix_cache_per_key),
        a.client,
        a.priority,
        a.speculate,
        thinking,
        a.shown_tokens,
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
