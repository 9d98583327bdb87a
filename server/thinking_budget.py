"""A reasoning model's thinking budget: at most N tokens inside its think block, then the block
is closed for it and the answer goes on freely (chat `max_thinking_tokens`, Responses
`reasoning.max_tokens`, Anthropic `thinking.budget_tokens`).

    budget = ThinkingBudget.of(tokenizer, 64, inside=True, tags=THINK)   # inside: the prompt opened it
    seq.constraint = budget.follow(grammar_constraint)        # one per answer (engine_io.TokenConstraint)

The budget is a token constraint (scheduler.engine_io.TokenConstraint, as structured output's
grammar): any token is allowed until the budget is spent inside the block; then only the next
token of the close tag (`</think>` or `[/THINK]` encoded by the model's tokenizer: one special
token for Qwen3 and Magistral, several for other vocabularies, forced in order). The block is
followed by the tokens' text, as server/reasoning.py reads it: the answer may open it itself
(Qwen3, Magistral) or start inside it (R1's templates); text that closes it on its own ends the
budget's work; an answer that does not open one is never constrained.

With a grammar (structured output), the grammar's mask comes first: when the budget is spent, the
close tag's next token is forced where the grammar allows it, and the grammar's mask is sent
unchanged where it does not (the grammar decides the answer's text; the block closes at the first
place the grammar lets it). The tag's own tokens count as thinking until it is whole; a budget
spent inside a tag the answer began forces the rest of it.

Speculative decoding: the agent refuses proposals for a slot whose next token is masked, and a
step samples every proposal kept and one more; so the budget sends no mask while tokens are free
(`mask()` None) and lets a sequence propose only the tokens that come before it is spent
(`free_tokens`: a step's k + 1 tokens all among them). With a grammar nothing is proposed.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from agent.model.tokenizer import TextTokenizer
from scheduler.engine_io import TokenConstraint
from server.reasoning import MAX_LEADING_SPACE, Tags

# BudgetConstraint's states
START, INSIDE, FORCING, DONE = "start", "inside", "forcing", "done"


@dataclass(frozen=True)
class ThinkingBudget:
    """A request's thinking budget on a model's vocabulary: `budget` tokens inside the block,
    `close_ids` the close tag's tokens, `inside` whether the prompt leaves the answer in the block,
    `piece` one token's text (to follow the block), `words` the mask's int32 words."""

    budget: int
    close_ids: tuple[int, ...]
    inside: bool
    piece: Callable[[int], str]
    words: int
    tags: Tags

    @classmethod
    def of(cls, tokenizer: TextTokenizer, budget: int, inside: bool, tags: Tags) -> ThinkingBudget:
        close = tuple(tokenizer.encode(tags.close, add_special_tokens=False))
        if not close:
            raise ValueError(f"the tokenizer encodes {tags.close!r} as no token")
        words = (tokenizer.vocab_size + 31) // 32
        return cls(budget, close, inside, lambda token: tokenizer.token_piece(token)[0], words, tags)

    def follow(self, grammar: TokenConstraint | None = None) -> BudgetConstraint:
        """One answer's constraint, composed with its grammar's (None: no grammar)."""
        return BudgetConstraint(self, grammar)


class BudgetConstraint:
    """One answer's place in its think block (scheduler.engine_io.TokenConstraint)."""

    def __init__(self, budget: ThinkingBudget, grammar: TokenConstraint | None = None):
        self.budget, self.grammar = budget, grammar
        self.state = INSIDE if budget.inside else START
        self.thought = 0  # tokens inside the block so far
        self.forced = 0  # close tag tokens forced so far
        self.text = ""  # START: the answer's text so far; else the last few characters
        self._spent()

    def mask(self) -> np.ndarray | None:
        grammar = None if self.grammar is None else self.grammar.mask()
        if self.state != FORCING:
            return grammar  # None without a grammar: any token
        token = self.budget.close_ids[self.forced]
        one = np.zeros(self.budget.words, dtype=np.uint32)
        one[token // 32] = np.uint32(1) << np.uint32(token % 32)
        forced = one.view(np.int32)
        if grammar is None:
            return forced
        both = grammar & forced
        return both if both.any() else grammar  # the grammar does not allow the close tag here

    @property
    def free_tokens(self) -> int | None:
        """Tokens that may come before the budget forces the tag (speculative decoding proposes
        within them); before the block opens, its open tag may be the first: the budget's tokens
        may follow it."""
        if self.grammar is not None:
            return 0  # the grammar's mask holds for one token
        if self.state == START:
            return self.budget.budget + 1
        if self.state == INSIDE:
            return self.budget.budget - self.thought
        return 0 if self.state == FORCING else None

    def advance(self, token: int) -> None:
        if self.grammar is not None:
            self.grammar.advance(token)  # ValueError if the grammar did not allow it
        if self.state == DONE:
            return
        text = self.text + self.budget.piece(token)
        tags = self.budget.tags
        if self.state == START:
            stripped = text.lstrip()
            if stripped.startswith(tags.open):
                self.state, self.text = INSIDE, stripped[len(tags.open) :][-len(tags.close) :]
                self._spent()
            elif not (tags.open.startswith(stripped) and len(text) - len(stripped) <= MAX_LEADING_SPACE):
                self.state = DONE  # the answer opens no block: it is all content
            else:
                self.text = text
            return
        if tags.close in text:  # closed: by the model itself, or the forced tag is complete
            self.state, self.text = DONE, ""
            return
        self.text = text[-len(tags.close) :]
        if self.state == FORCING:
            # the forced token, or (a grammar that did not allow it) another: force the tag again
            matched = token == self.budget.close_ids[self.forced]
            self.forced = self.forced + 1 if matched else self._begun()
            if self.forced == len(self.budget.close_ids):
                self.state = DONE  # a tag whose tokens do not spell it as text ends here too
            return
        self.thought += 1
        self._spent()

    def _spent(self) -> None:
        if self.state == INSIDE and self.thought >= self.budget.budget:
            self.state, self.forced = FORCING, self._begun()

    def _begun(self) -> int:
        """How many of the tag's tokens the answer's text ends with: a tag it began is finished."""
        close = self.budget.close_ids
        for tokens in range(len(close) - 1, 0, -1):
            if self.text.endswith("".join(self.budget.piece(t) for t in close[:tokens])):
                return tokens
        return 0

    @property
    def complete(self) -> bool:
        return self.grammar is not None and self.grammar.complete
