"""The thinking budget's token constraint (server/thinking_budget.py), walked as the engine walks it:
each step the mask, then the token chosen. The "model" wants to write a text; where the mask
allows one token only, that token is taken. The tiny vocabulary spells `</think>` in 8 tokens (the
tag forced in order); a vocabulary with `</think>` as one special token (Qwen3's) forces one."""

import asyncio

import numpy as np
import pytest
from tokenizers import AddedToken

from agent.model.tokenizer import TextTokenizer, load_tokenizer
from server.reasoning import MISTRAL, THINK
from server.structured_output import Grammars, GrammarSpec
from server.thinking_budget import BudgetConstraint, ThinkingBudget


@pytest.fixture(scope="module")
def chars(tiny_llama_dir) -> TextTokenizer:
    return load_tokenizer(tiny_llama_dir)


@pytest.fixture(scope="module")
def special(tiny_llama_dir) -> TextTokenizer:
    """The tiny vocabulary with `<think>` and `</think>` as special tokens, as Qwen3's has them, and
    `[THINK]` and `[/THINK]`, as Magistral's has them."""
    inner = load_tokenizer(tiny_llama_dir).tokenizer
    tags = [THINK.open, THINK.close, MISTRAL.open, MISTRAL.close]
    inner.add_special_tokens([AddedToken(tag, special=True) for tag in tags])
    return TextTokenizer(inner, None, None, None, ())


def allowed(mask: np.ndarray | None, vocab: int) -> set[int]:
    if mask is None:  # no mask: any token
        return set(range(vocab))
    return set(np.flatnonzero(np.unpackbits(mask.view(np.uint8), bitorder="little")[:vocab]).tolist())


def walk(tokenizer: TextTokenizer, constraint: BudgetConstraint, wanted: list[int], steps: int) -> list[int]:
    """`steps` tokens: the forced tag's token where the mask allows it alone (the model's wish
    put off), else the wanted one where the mask allows it, else the mask's one token."""
    out: list[int] = []
    wanted = list(wanted)
    for _ in range(steps):
        mask = allowed(constraint.mask(), tokenizer.vocab_size)
        if constraint.state == "forcing" and mask == {constraint.budget.close_ids[constraint.forced]}:
            token = next(iter(mask))
            if wanted and wanted[0] == token:  # the model wrote this token of the tag itself
                wanted.pop(0)
        elif wanted and wanted[0] in mask:
            token = wanted.pop(0)
        else:
            assert len(mask) == 1, f"after {out}: {len(mask)} tokens allowed, not the wanted {wanted[:1]}"
            token = next(iter(mask))
        constraint.advance(token)
        out.append(token)
    return out


def ids(tokenizer: TextTokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


@pytest.mark.parametrize("budget", [0, 1, 3, 7])
def test_an_answer_inside_the_block_thinks_n_tokens_then_the_close_tag_is_forced(chars, budget):
    close = ids(chars, THINK.close)
    assert len(close) > 1  # the tag is several tokens here: forced in order
    thinking = ids(chars, "abcdefgjlmopqrsuvw")  # no letter of the tag: the model does not write it
    constraint = ThinkingBudget.of(chars, budget, inside=True, tags=THINK).follow()
    out = walk(chars, constraint, thinking + ids(chars, "answer"), budget + len(close) + 6)
    # the answer continues freely after the tag: the model's next wanted tokens, the thinking it had left
    assert out == thinking[:budget] + close + thinking[budget : budget + 6]
    assert len(allowed(constraint.mask(), chars.vocab_size)) == chars.vocab_size
    assert not constraint.complete


def test_budget_zero_inside_forces_the_tag_first(chars):
    constraint = ThinkingBudget.of(chars, 0, inside=True, tags=THINK).follow()
    assert allowed(constraint.mask(), chars.vocab_size) == {ids(chars, THINK.close)[0]}


def test_an_answer_that_opens_the_block_itself_is_counted_from_the_open_tag(chars):
    constraint = ThinkingBudget.of(chars, 2, inside=False, tags=THINK).follow()
    wanted = ids(chars, " \n<think>xyzw")
    out = walk(chars, constraint, wanted, len(wanted) - 2 + 8 + 1)
    assert chars.decode(out) == " \n<think>xy</think>z"


@pytest.mark.parametrize("budget", [5, 9, 10, 30])
def test_a_tag_the_model_began_is_finished_not_restarted(chars, budget):
    # the tag's own tokens count as thinking until it is whole: 9 of them here ("ab</think");
    # a budget spent inside the tag forces the rest of it
    constraint = ThinkingBudget.of(chars, budget, inside=True, tags=THINK).follow()
    wanted = ids(chars, "ab</think>" + "q" * 20)
    assert walk(chars, constraint, wanted, len(wanted)) == wanted
    assert len(allowed(constraint.mask(), chars.vocab_size)) == chars.vocab_size
    assert constraint.state == "done"


def test_an_answer_without_a_block_is_never_constrained(chars):
    constraint = ThinkingBudget.of(chars, 0, inside=False, tags=THINK).follow()
    wanted = ids(chars, "Paris" + "q" * 20)
    assert walk(chars, constraint, wanted, len(wanted)) == wanted


@pytest.mark.parametrize("tags", [THINK, MISTRAL])
def test_a_one_token_close_tag_is_forced_once(special, tags):
    close = ids(special, tags.close)
    assert len(close) == 1
    constraint = ThinkingBudget.of(special, 2, inside=False, tags=tags).follow()
    wanted = ids(special, tags.open + "abcdef")
    assert len(wanted) == 7  # the open tag is one token too
    out = walk(special, constraint, wanted, 5)
    assert out == wanted[:3] + close + [wanted[3]]


def test_with_a_grammar_the_tag_is_forced_where_the_grammar_allows_it(chars):
    grammars = Grammars(chars, 10_000, 30.0)
    grammar = asyncio.run(grammars.compile(GrammarSpec("regex", "abc[a-z]*</think>answer")))
    constraint = ThinkingBudget.of(chars, 1, inside=True, tags=THINK).follow(grammar.follow())
    wanted = ids(chars, "abcdefg")
    out = walk(chars, constraint, wanted, 3 + 8 + 6)
    # the grammar holds "abc" past the budget; then "</think>" is forced and the grammar ends it
    assert chars.decode(out) == "abc</think>answer" and constraint.complete


def test_a_token_outside_the_grammar_is_refused(chars):
    grammars = Grammars(chars, 10_000, 30.0)
    grammar = asyncio.run(grammars.compile(GrammarSpec("regex", "abc")))
    constraint = ThinkingBudget.of(chars, 4, inside=True, tags=THINK).follow(grammar.follow())
    with pytest.raises(ValueError, match="not allowed"):
        constraint.advance(ids(chars, "z")[0])


@pytest.mark.parametrize(("inside", "text"), [(True, "abcdefgjlmopq"), (False, "<think>abcdefgjlmopq")])
def test_free_tokens_never_promise_a_token_the_budget_would_force(chars, inside, text):
    """Speculative decoding proposes within free_tokens: each step's count is at most the steps
    left before the first forced token (exactly those, inside the block), and no mask goes out
    while tokens are free."""
    budget = 4
    constraint = ThinkingBudget.of(chars, budget, inside=inside, tags=THINK).follow()
    frees, masked = [], []
    for token in ids(chars, text)[:12]:
        frees.append(constraint.free_tokens)
        masked.append(constraint.mask() is not None)
        if masked[-1]:
            break
        constraint.advance(token)
    forced_at = masked.index(True)
    assert not any(masked[:forced_at]) and frees[forced_at] == 0
    for step, free in enumerate(frees[:forced_at]):
        assert free is not None and 0 < free <= forced_at - step
        if inside:
            assert free == forced_at - step


def test_a_closed_block_frees_every_token_and_a_grammar_none(chars):
    constraint = ThinkingBudget.of(chars, 3, inside=True, tags=THINK).follow()
    for token in ids(chars, "a</think>b"):
        constraint.advance(token)
    assert constraint.free_tokens is None and constraint.mask() is None
    grammars = Grammars(chars, 10_000, 30.0)
    grammar = asyncio.run(grammars.compile(GrammarSpec("regex", "[a-z]+")))
    assert ThinkingBudget.of(chars, 3, inside=True, tags=THINK).follow(grammar.follow()).free_tokens == 0


def test_a_grammar_that_never_allows_the_tag_keeps_its_text(chars):
    grammars = Grammars(chars, 10_000, 30.0)
    grammar = asyncio.run(grammars.compile(GrammarSpec("regex", "[a-z]{12}")))
    constraint = ThinkingBudget.of(chars, 1, inside=True, tags=THINK).follow(grammar.follow())
    wanted = ids(chars, "abcdefgjlmop")
    assert walk(chars, constraint, wanted, 12) == wanted and constraint.complete
