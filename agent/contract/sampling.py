"""Sampling parameters of one sequence and their limits: part of the prefill message and of the HTTP
APIs' requests, and the sampling parameters other servers name that no API here serves. The agent
applies them (agent/sampling.py)."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable, Collection, Mapping
from typing import Annotated, Any, Literal, NamedTuple

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

# Beyond these an int no longer fits the wire's msgpack or NumPy's types; a larger top_k would
# mean the whole vocabulary anyway.
MAX_TOP_K = 2**31 - 1
MAX_SEED = 2**63 - 1
# Stop strings: every new token of a stream is checked against each, over the held-back text (up to
# the longest one): bounded so that no request can make that cost more than a few hundred
# characters a token. OpenAI allows 4; TGI 4 as well.
MAX_STOP_STRINGS = 4
MAX_STOP_CHARS = 256
# Logprobs: OpenAI's bound on the alternatives per token (each costs a sort and bytes on the wire).
MAX_LOGPROBS = 20
# logit_bias and stop_token_ids are applied per token, per entry: bounded like stop strings.
MAX_LOGIT_BIAS = 1024
MAX_LOGIT_BIAS_VALUE = 100.0
MAX_STOP_TOKEN_IDS = 64
# Sampling numerics: the logits are divided by the temperature and the repetition penalty, so
# values near zero overflow them (1e-300 made every logprob NaN). Below GREEDY_TEMPERATURE (vLLM's
# 1e-5) a request is greedy; the bounds keep every scaled logit finite in float64.
GREEDY_TEMPERATURE = 1e-5
MAX_TEMPERATURE = 100.0
MIN_REPETITION_PENALTY = 0.01
MAX_REPETITION_PENALTY = 100.0
MAX_PENALTY = 2.0  # presence_penalty and frequency_penalty: OpenAI's bound
# A request's prefix-cache salt (vLLM's cache_salt): a tenant's requests share cached prompt blocks
# only with each other.
MAX_CACHE_SALT_CHARS = 256
# Pydantic's str refuses a lone surrogate (which JSON's "\ud800" escape would carry), so a salt is
# always text that hashes as UTF-8 (scheduler/block_manager.py).
CacheSalt = Annotated[str, Field(min_length=1, max_length=MAX_CACHE_SALT_CHARS)]
MAX_PRIORITY = 2**31 - 1  # a request's priority (lower first) lies within +-this
# A pooling request's logits (a reranker's label tokens, SamplingParams.pool): a few, as each is
# a float on the wire per request
MAX_POOLED_LOGITS = 16
# What a prompt gives back beside its token (SamplingParams.pool): "hidden", its last row's final
# hidden state (after the final norm: a decoder's embedding); "mean" or "cls", the mean of its rows'
# or its first row's (an encoder's, whose prompts run whole); each then through the model's dense
# projections, if it has any; or the logits of these token ids at its last row (a reranker's labels)
Pool = (
    Literal["hidden", "mean", "cls"]
    | Annotated[tuple[Annotated[int, Field(ge=0)], ...], Field(min_length=1, max_length=MAX_POOLED_LOGITS)]
)


def check_stop_strings(stop: list[str]) -> list[str]:
    """The request's stop strings within the bounds (ValueError naming them otherwise)."""
    if len(stop) > MAX_STOP_STRINGS:
        raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings, got {len(stop)}")
    if any(len(s) > MAX_STOP_CHARS for s in stop):
        raise ValueError(f"a stop string may hold at most {MAX_STOP_CHARS} characters")
    return stop


def _token_ids(value: tuple[int, ...]) -> tuple[int, ...]:
    if any(token < 0 for token in value):
        raise ValueError("stop_token_ids must be token ids (>= 0)")
    return value


def _bias_pairs(value: tuple[tuple[int, float], ...]) -> tuple[tuple[int, float], ...]:
    for token, bias in value:
        if token < 0 or not -MAX_LOGIT_BIAS_VALUE <= bias <= MAX_LOGIT_BIAS_VALUE:
            raise ValueError(f"logit_bias maps token ids (>= 0) to biases in -100..100, got {token}: {bias}")
    return value


# The rules of stop_token_ids and logit_bias, for every request body that takes them as well as
# SamplingParams (whether the ids lie in the vocabulary is the server's to check: it knows it).
StopTokenIds = Annotated[tuple[int, ...], Field(max_length=MAX_STOP_TOKEN_IDS), AfterValidator(_token_ids)]
LogitBias = Annotated[
    tuple[tuple[int, float], ...], Field(max_length=MAX_LOGIT_BIAS), AfterValidator(_bias_pairs)
]


def _off_at(*values: Any) -> Callable[[Any], bool]:
    return lambda value: value in values


# Sampling parameters that llama.cpp's server, vLLM, Ollama or transformers name and that no sampler
# here implements, each with whether a value asks for nothing (that sampler is off at it, as clients
# send it by default). A request that asks for one is refused naming it (every API's request checks
# its body with unserved_sampling()): answered without it, a client tuned for those servers would
# get other answers and no error.
UNSERVED_SAMPLING: dict[str, Callable[[Any], bool]] = {
    # llama.cpp (Ollama names its options alike)
    "mirostat": _off_at(0),
    "dry_multiplier": _off_at(0),
    "xtc_probability": _off_at(0),
    "top_n_sigma": lambda value: type(value) in (int, float) and value <= 0,
    "dynatemp_range": _off_at(0),
    "tfs_z": _off_at(1),
    "top_a": _off_at(0),
    "penalize_nl": _off_at(False),
    "repeat_penalty": _off_at(1),
    "n_probs": _off_at(0),
    "min_keep": _off_at(0, 1),
    "samplers": _off_at(),
    # vLLM
    "use_beam_search": _off_at(False),
    "best_of": _off_at(1),  # /v1/completions serves best_of = n itself
    "length_penalty": _off_at(1),
    "early_stopping": _off_at(False),
    "bad_words": _off_at([]),
    "allowed_token_ids": _off_at(),
    "logits_processors": _off_at([]),
    # transformers (TGI)
    "penalty_alpha": _off_at(0),
    "eta_cutoff": _off_at(0),
    "epsilon_cutoff": _off_at(0),
    "num_beams": _off_at(1),
    "no_repeat_ngram_size": _off_at(0),
}
# Settings of the samplers above: they ask for nothing while every sampler they set is off.
UNSERVED_SETTINGS: dict[str, tuple[str, ...]] = {
    "mirostat_tau": ("mirostat",),
    "mirostat_eta": ("mirostat",),
    "dry_base": ("dry_multiplier",),
    "dry_allowed_length": ("dry_multiplier",),
    "dry_penalty_last_n": ("dry_multiplier",),
    "dry_sequence_breakers": ("dry_multiplier",),
    "xtc_threshold": ("xtc_probability",),
    "dynatemp_exponent": ("dynatemp_range",),
    # llama.cpp's window of its penalties: here they cover the whole prompt and answer
    "repeat_last_n": ("repetition_penalty", "repeat_penalty", "presence_penalty", "frequency_penalty"),
}
# This server's names for what some of them ask, said in the refusal.
UNSERVED_HINTS = {"repeat_penalty": "repetition_penalty", "n_probs": "logprobs"}
_SERVED_OFF = {"repetition_penalty": 1, "presence_penalty": 0, "frequency_penalty": 0}


def _asks_nothing(name: str, value: Any) -> bool:
    if value is None:
        return True
    if name in _SERVED_OFF:
        return value == _SERVED_OFF[name]
    return UNSERVED_SAMPLING[name](value)


def unserved_sampling(body: Mapping[str, Any], served: Collection[str] = ()) -> str | None:
    """The parameters of a request `body` (its fields by name) that ask for a sampler this server
    lacks, as a message naming them; None if none do. `served`: the names the API takes itself."""
    asked = [
        name
        for name, value in body.items()
        if name not in served
        and (
            (name in UNSERVED_SAMPLING and not _asks_nothing(name, value))
            or (
                name in UNSERVED_SETTINGS
                and value is not None
                and not all(_asks_nothing(s, body.get(s)) for s in UNSERVED_SETTINGS[name])
            )
        )
    ]
    if not asked:
        return None
    names = ", ".join(f"{n} (send {UNSERVED_HINTS[n]})" if n in UNSERVED_HINTS else n for n in asked)
    one = len(asked) == 1
    verb, pronoun = ("is", "it") if one else ("are", "them")
    return f"{names} {verb} not supported: no sampler of this server implements {pronoun}"


class SamplingParams(BaseModel):
    model_config = ConfigDict(frozen=True, allow_inf_nan=False)

    do_sample: bool = False
    temperature: float = Field(1.0, ge=0.0, le=MAX_TEMPERATURE)  # below GREEDY_TEMPERATURE: greedy
    top_k: int = Field(0, ge=0, le=MAX_TOP_K)  # 0: no top-k limit
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    # min_p: only tokens at least this share of the most likely one's probability (0: off);
    # typical_p: locally typical sampling's mass (1: off). agent/sampling.py says where each applies.
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    typical_p: float = Field(1.0, gt=0.0, le=1.0)
    repetition_penalty: float = Field(1.0, ge=MIN_REPETITION_PENALTY, le=MAX_REPETITION_PENALTY)
    presence_penalty: float = Field(0.0, ge=0.0, le=MAX_PENALTY)
    frequency_penalty: float = Field(0.0, ge=0.0, le=MAX_PENALTY)
    seed: int | None = Field(None, ge=0, le=MAX_SEED)
    # None: no logprobs; n: the chosen token's and the n best tokens' (agent/sampling.py says of
    # which distribution)
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    # None: no prompt logprobs; k: each prompt position's logprob with the k best tokens'
    # (agent/contract/prompt_logprobs.py); such a prompt is computed without prefix-cache hits
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    logit_bias: LogitBias = ()  # (id, bias)
    min_tokens: int = Field(0, ge=0)  # the stop ids below and EOS cannot be sampled before
    stop_token_ids: StopTokenIds = ()  # end it, like EOS
    # A pooling request (embeddings, scores): what its prompt's last row returns (Pool); None for
    # generation
    pool: Pool | None = None

    @property
    def greedy(self) -> bool:
        return not self.do_sample or self.temperature < GREEDY_TEMPERATURE or self.top_k == 1

    def largest_token_id(self) -> int:
        """The largest token id the parameters name (-1 if none): the caller checks its vocabulary."""
        pooled = list(self.pool) if isinstance(self.pool, tuple) else []
        return max([t for t, _ in self.logit_bias] + list(self.stop_token_ids) + pooled, default=-1)


class TokenLogprob(NamedTuple):
    """A sampled token's log-probability and the `logprobs` best tokens' (id, logprob), best first."""

    logprob: float
    top: tuple[tuple[int, float], ...] = ()

    def to_wire(self) -> list:
        return [self.logprob, [[token, value] for token, value in self.top]]

    @classmethod
    def from_wire(cls, value) -> TokenLogprob:
        """The inverse of to_wire(); anything else raises ValueError."""
        try:
            logprob, top = value
            entry = cls(float(logprob), tuple((int(t), float(v)) for t, v in top))
        except (TypeError, ValueError) as e:
            raise ValueError(f"not a token logprob: {value!r:.200}") from e
        values = [entry.logprob] + [v for _, v in entry.top]
        if len(entry.top) > MAX_LOGPROBS or not all(math.isfinite(v) and v <= 0 for v in values):
            raise ValueError(f"not a token logprob: {value!r:.200}")
        return entry


MAX_FAULT_CHARS = 500
FAULT_KINDS = ("request", "internal")


class SequenceFault(NamedTuple):
    """Why one sequence of a call got no token: that sequence's error, not the agent's (the call
    went on for the others). kind "request": its own parameters left nothing to sample (a grammar
    that allows only what min_tokens forbids); "internal": a value the agent could not compute."""

    kind: str
    message: str

    def to_wire(self) -> list:
        return [self.kind, self.message]

    @classmethod
    def from_wire(cls, value) -> SequenceFault:
        """The inverse of to_wire(); anything else raises ValueError."""
        if (
            not isinstance(value, list)
            or len(value) != 2
            or value[0] not in FAULT_KINDS
            or not isinstance(value[1], str)
        ):
            raise ValueError(f"not a sequence fault: {value!r:.200}")
        return cls(value[0], value[1][:MAX_FAULT_CHARS])


class Sampled(NamedTuple):
    """A token an agent sampled, with its logprobs when the request asked for them; or, instead
    of a token (NO_TOKEN), the fault that ended that sequence."""

    token: int
    logprob: TokenLogprob | None = None
    fault: SequenceFault | None = None


NO_TOKEN = -1  # the token of a sequence whose choice failed (its SequenceFault says why)


# The command lines that sample (the client's, tools.generate) take the same options.
SAMPLING_OPTIONS = ("do_sample", "temperature", "top_k", "top_p", "repetition_penalty", "seed")


def add_sampling_options(parser: argparse.ArgumentParser, top_k: int) -> None:
    """--do-sample, --temperature, --top-k (default `top_k`), --top-p, --repetition-penalty, --seed."""
    parser.add_argument("--do-sample", action="store_true")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=top_k)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--repetition-penalty", type=float, default=1.0)
    parser.add_argument("--seed", type=int)


def sampling_options(args: argparse.Namespace) -> dict:
    """The options add_sampling_options() parsed, named as SamplingParams' fields."""
    return {name: getattr(args, name) for name in SAMPLING_OPTIONS}
