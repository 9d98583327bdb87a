"""Structured output: a grammar (JSON Schema, any JSON object, a regex, a choice of strings, a Lark
grammar) compiled by llguidance; each sequence that follows one gets a matcher, whose token mask
goes to the agent with every step that samples for it (scheduler.engine_io.TokenConstraint).

    grammars = Grammars(tokenizer, max_bytes, timeout_s)  # llguidance's view of the vocabulary
    grammar = await grammars.compile(GrammarSpec("json", schema_text))  # off the event loop, cached
    seq.constraint = grammar.follow()                     # one per sequence

Why llguidance (measured on this machine, SmolLM2's 49152-token vocabulary, 16 streams walking a
nested JSON Schema): mask 0.10 ms a row (p90 0.16), compile 1-8 ms; outlines-core masks in 0.007 ms
but compiles its regex index for 0.7-4.3 s per schema and has no context-free grammars; xgrammar
needs torch, transformers and triton. llguidance is 3 MB with no dependencies, and its parser limits
bound the CPU a grammar may cost per token.

What one request's grammar may cost is bounded: its text (server.max_grammar_bytes: compile time
grows faster than the size, 0.5 s for a 240 KB Lark grammar of 20,000 alternatives), its compile
time (server.grammar_compile_timeout_s; a grammar that failed or timed out is refused again at once,
from the cache, instead of compiling again), the lexer's work at the start and at each token (its
fuel and states: a mask is computed on the event loop every step), and compiles run in a small
pool beside each other, so one slow grammar does not hold the others back.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import llguidance
import numpy as np

from agent.model.tokenizer import TextTokenizer

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

GrammarKind = Literal["json", "json_object", "regex", "choice", "lark"]
CACHED_GRAMMARS = 256
COMPILE_THREADS = 2
# llguidance's fuel: ~50 units a microsecond at the start, ~14 at each token. (a{1000}){1000} took
# 0.69 s for its first mask with the defaults (1M, 200k), 0.07 s with these.
INITIAL_LEXER_FUEL, STEP_LEXER_FUEL, MAX_LEXER_STATES = 200_000, 100_000, 50_000
# JSON as json.dumps writes it (", " and ": "), no other whitespace: a small model given free
# whitespace may emit newlines forever instead of closing the object.
JSON_OPTIONS: JsonCompileOptions = {
    "item_separator": ", ",
    "key_separator": ": ",
    "whitespace_flexible": False,
}


class GrammarError(ValueError):
    """A grammar that cannot be compiled; the message says why."""


@dataclass(frozen=True)
class GrammarSpec:
    kind: GrammarKind
    value: str  # the schema as JSON text, the regex, the choices as a JSON list, the Lark grammar


class Grammar:
    """A compiled grammar: a matcher ready at its start, copied for each sequence."""

    def __init__(self, matcher: llguidance.LLMatcher, words: int, first: np.ndarray):
        self._start, self.words = matcher, words
        self.first = first  # the ids of the tokens it allows first

    def follow(self) -> GrammarConstraint:
        return GrammarConstraint(self._start.deep_copy(), self.words)


class GrammarConstraint:
    """One sequence's place in its grammar (scheduler.engine_io.TokenConstraint)."""

    def __init__(self, matcher: llguidance.LLMatcher, words: int):
        self.matcher, self.words = matcher, words

    def mask(self) -> np.ndarray:
        # llguidance's mask may hold a word more than the vocabulary needs (no token's bit is set there)
        return np.frombuffer(self.matcher.compute_bitmask(), dtype="<i4")[: self.words].astype(np.int32)

    def advance(self, token: int) -> None:
        if not self.matcher.consume_token(token):
            raise ValueError(f"token {token} is not allowed here: {self.matcher.get_error()}")

    @property
    def free_tokens(self) -> int:
        return 0  # its mask holds for one token: nothing is proposed

    @property
    def complete(self) -> bool:
        return self.matcher.is_stopped()


class Grammars:
    """Compiles grammars in a small pool of threads (llguidance drops the GIL while it builds),
    keeps the last CACHED_GRAMMARS outcomes, compiled grammars and refusals alike (the same schema
    is compiled once; a bad one is refused again at once), compiles a grammar asked for by several
    requests at once once, and refuses invalid, too large or too slow ones with a message."""

    def __init__(self, tokenizer: TextTokenizer, max_bytes: int, timeout_s: float):
        self.tokenizer, self.max_bytes, self.timeout_s = tokenizer, max_bytes, timeout_s
        self._llg_tokenizer: llguidance.LLTokenizer | None = None  # built on first use (0.2 s)
        self._cache: OrderedDict[GrammarSpec, Grammar | GrammarError] = OrderedDict()
        self._compiling: dict[GrammarSpec, asyncio.Future[Grammar]] = {}
        self._pool = ThreadPoolExecutor(COMPILE_THREADS, thread_name_prefix="grammar")

    async def compile(self, spec: GrammarSpec) -> Grammar:
        size = len(spec.value.encode())
        if size > self.max_bytes:
            raise GrammarError(
                f"it has {size} bytes; at most {self.max_bytes} are accepted (server.max_grammar_bytes)"
            )
        cached = self._cache.get(spec)
        if cached is None:
            cached = await self._compiled(spec)
        self._cache.move_to_end(spec)
        if isinstance(cached, GrammarError):
            raise cached
        return cached

    async def _compiled(self, spec: GrammarSpec) -> Grammar | GrammarError:
        """The outcome of compiling `spec` (this request's compile, or one already running)."""
        future = self._compiling.get(spec)
        if future is None:
            future = asyncio.get_running_loop().run_in_executor(self._pool, self._compile, spec)
            self._compiling[spec] = future
            future.add_done_callback(lambda done: self._compiled_late(spec, done))
        try:
            return await asyncio.wait_for(asyncio.shield(future), self.timeout_s)
        except GrammarError as exc:
            return self._remember(spec, exc)
        except TimeoutError:
            return self._remember(
                spec,
                GrammarError(
                    f"it did not compile within {self.timeout_s:g}s (server.grammar_compile_timeout_s)"
                ),
            )

    def _compiled_late(self, spec: GrammarSpec, done: asyncio.Future) -> None:
        """A compile ended (its requests may have stopped waiting): its outcome is kept, unless
        a timeout was kept for it already."""
        self._compiling.pop(spec, None)
        if spec in self._cache or done.cancelled():
            return
        error = done.exception()
        if error is None or isinstance(error, GrammarError):
            self._remember(spec, error or done.result())

    def _remember(self, spec: GrammarSpec, outcome: Grammar | GrammarError) -> Grammar | GrammarError:
        self._cache.setdefault(spec, outcome)
        while len(self._cache) > CACHED_GRAMMARS:
            self._cache.popitem(last=False)
        return self._cache[spec]

    def _compile(self, spec: GrammarSpec) -> Grammar:
        grammar = _grammar_text(spec)
        limits = llguidance.LLParserLimits(
            initial_lexer_fuel=INITIAL_LEXER_FUEL,
            step_lexer_fuel=STEP_LEXER_FUEL,
            max_lexer_states=MAX_LEXER_STATES,
        )
        problem = llguidance.LLMatcher.validate_grammar(grammar, self._tokenizer(), limits=limits)
        if problem:
            raise GrammarError(problem)
        matcher = llguidance.LLMatcher(self._tokenizer(), grammar, log_level=0, limits=limits)
        # The first mask builds the lexer: here, in this thread, not in the engine's first step.
        words = (self.tokenizer.vocab_size + 31) // 32
        first = np.frombuffer(matcher.compute_bitmask(), dtype="<u4")[:words]
        if matcher.is_error():
            raise GrammarError(matcher.get_error())
        allowed = np.unpackbits(first.view(np.uint8), bitorder="little")[: self.tokenizer.vocab_size]
        return Grammar(matcher, words, np.flatnonzero(allowed))

    def _tokenizer(self) -> llguidance.LLTokenizer:
        if self._llg_tokenizer is None:
            self._llg_tokenizer = llguidance.LLTokenizer(
                self.tokenizer.tokenizer.to_str(),
                n_vocab=self.tokenizer.vocab_size,
                eos_token=list(self.tokenizer.eos_ids) or None,
            )
        return self._llg_tokenizer


def _grammar_text(spec: GrammarSpec) -> str:
    """llguidance's grammar for a spec (GrammarError for a value that is not what its kind needs)."""
    try:
        if spec.kind == "json":
            return llguidance.LLMatcher.grammar_from_json_schema(spec.value, defaults=JSON_OPTIONS)
        if spec.kind == "json_object":
            return llguidance.LLMatcher.grammar_from_json_schema('{"type": "object"}', defaults=JSON_OPTIONS)
        if spec.kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(spec.value)
        if spec.kind == "choice":
            return llguidance.LLMatcher.grammar_from_regex(
                "|".join(re.escape(c) for c in json.loads(spec.value))
            )
        return llguidance.LLMatcher.grammar_from_lark(spec.value)
    except ValueError as exc:
        raise GrammarError(str(exc)) from exc
