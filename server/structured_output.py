"""Structured output: a grammar (JSON Schema, any JSON object, a regex, a choice of strings, a Lark
grammar) compiled by llguidance; each sequence that follows one gets a matcher, whose token mask
goes to the agent with every step that samples for it (scheduler.sequence.TokenConstraint).

    grammars = Grammars(tokenizer)                        # llguidance's view of the vocabulary
    grammar = await grammars.compile(GrammarSpec("json", schema_text))  # off the event loop, cached
    seq.constraint = grammar.follow()                     # one per sequence

Why llguidance (measured on this machine, SmolLM2's 49152-token vocabulary, 16 streams walking a
nested JSON Schema): mask 0.10 ms a row (p90 0.16), compile 1-8 ms; outlines-core masks in 0.007 ms
but compiles its regex index for 0.7-4.3 s per schema and has no context-free grammars; xgrammar
needs torch, transformers and triton. llguidance is 3 MB with no dependencies, and its parser limits
bound the CPU a grammar may cost per token.
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

    def __init__(self, matcher: llguidance.LLMatcher, words: int):
        self._start, self.words = matcher, words

    def follow(self) -> GrammarConstraint:
        return GrammarConstraint(self._start.deep_copy(), self.words)


class GrammarConstraint:
    """One sequence's place in its grammar (scheduler.sequence.TokenConstraint)."""

    def __init__(self, matcher: llguidance.LLMatcher, words: int):
        self.matcher, self.words = matcher, words

    def mask(self) -> np.ndarray:
        # llguidance's mask may hold a word more than the vocabulary needs (no token's bit is set there)
        return np.frombuffer(self.matcher.compute_bitmask(), dtype="<i4")[: self.words].astype(np.int32)

    def advance(self, token: int) -> None:
        if not self.matcher.consume_token(token):
            raise ValueError(f"token {token} is not allowed here: {self.matcher.get_error()}")

    @property
    def complete(self) -> bool:
        return self.matcher.is_stopped()


class Grammars:
    """Compiles grammars in one worker thread (llguidance drops the GIL while it builds), keeps the
    last CACHED_GRAMMARS compiled ones (the same schema is compiled once), and refuses invalid ones
    with the engine's message."""

    def __init__(self, tokenizer: TextTokenizer):
        self.tokenizer = tokenizer
        self._llg_tokenizer: llguidance.LLTokenizer | None = None  # built on first use (0.2 s)
        self._cache: OrderedDict[GrammarSpec, Grammar] = OrderedDict()
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="grammar")

    async def compile(self, spec: GrammarSpec) -> Grammar:
        cached = self._cache.get(spec)
        if cached is None:
            cached = await asyncio.get_running_loop().run_in_executor(self._pool, self._compile, spec)
            self._cache[spec] = cached
            while len(self._cache) > CACHED_GRAMMARS:
                self._cache.popitem(last=False)
        self._cache.move_to_end(spec)
        return cached

    def _compile(self, spec: GrammarSpec) -> Grammar:
        grammar = _grammar_text(spec)
        problem = llguidance.LLMatcher.validate_grammar(grammar, self._tokenizer())
        if problem:
            raise GrammarError(problem)
        matcher = llguidance.LLMatcher(self._tokenizer(), grammar, log_level=0)
        if matcher.is_error():
            raise GrammarError(matcher.get_error())
        return Grammar(matcher, (self.tokenizer.vocab_size + 31) // 32)

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
