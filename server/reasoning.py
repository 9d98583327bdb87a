"""A reasoning model's thinking, read apart from its answer (vLLM's and llama.cpp's `reasoning_content`).

Qwen3, QwQ and DeepSeek-R1's distills think in a `<think>...</think>` block before they answer;
Magistral and Ministral's reasoning models in `[THINK]...[/THINK]` (control tokens of their
vocabularies, which a text decode drops: the answer's text keeps them, `shown_markers`). Qwen3
and Magistral write the open tag themselves; the R1 templates put it at the end of the prompt, so
the answer starts inside the block (`inside`). Thinking turned off (Qwen3's enable_thinking false)
writes an empty block into the prompt: the answer starts outside. Whether a model reasons, and
with which tags, is `model.reasoning_parser`'s, `auto` reading it from its chat template.

Text after the close tag is the content (its leading whitespace dropped); an answer cut while
thinking is all reasoning; an answer that does not open a block is all content. Streamed, text that
could be the start of a tag is held back, never more than a tag's length (or MAX_LEADING_SPACE of
leading whitespace): the scan is linear in the answer.
"""

from __future__ import annotations

from dataclasses import dataclass

from agent.model.detokenizer import IncrementalDetokenizer
from agent.model.tokenizer import TextTokenizer

# Leading whitespace held back while the answer may still open a think block; beyond: content.
MAX_LEADING_SPACE = 64
# Prompt tokens read back to see whether the template opened a think block (R1's `<think>\n`).
PROMPT_TAIL_TOKENS = 16


@dataclass(frozen=True)
class Tags:
    """A reasoning format's open and close tags."""

    open: str
    close: str


THINK = Tags("<think>", "</think>")  # Qwen3, QwQ, DeepSeek-R1 and its distills
MISTRAL = Tags("[THINK]", "[/THINK]")  # Magistral, Ministral 3 Reasoning
PARSERS = {"think": THINK, "mistral": MISTRAL}  # model.reasoning_parser's names (vLLM's: mistral)


def tags_of(template: str | None, setting: str) -> Tags | None:
    """The tags a model's answers are read for (model.reasoning_parser; auto: its template's),
    or None: the model does not reason."""
    if setting != "auto":
        return PARSERS.get(setting)
    text = template or ""
    if THINK.open in text:
        return THINK
    return MISTRAL if MISTRAL.open in text else None


def reasons(template: str | None, setting: str) -> bool:
    """Whether answers are read for a think block."""
    return tags_of(template, setting) is not None


def opens_inside(prompt_tail: str, tags: Tags = THINK) -> bool:
    """Whether the prompt (its last tokens' text) leaves a think block open for the answer."""
    start = prompt_tail.rfind(tags.open)
    return start >= 0 and not prompt_tail[start + len(tags.open) :].strip()


def of_answers(tokenizer: TextTokenizer, setting: str, prompt: list[int]) -> Reasoning | None:
    """How a chat's answers are split (None: the model does not reason, or the setting says none)."""
    tags = tags_of(tokenizer.chat_template, setting)
    if tags is None:
        return None
    tail = tokenizer.decode(prompt[-PROMPT_TAIL_TOKENS:], skip_special_tokens=False)
    return Reasoning(opens_inside(tail, tags), tags, shown_markers(tokenizer, tags))


def shown_markers(tokenizer: TextTokenizer, tags: Tags | None) -> frozenset[int]:
    """The tags that the vocabulary holds as special tokens, which a decode drops (Magistral's
    [THINK] and [/THINK]): the answer's text keeps them, for its thinking to be read apart."""
    return frozenset() if tags is None else tokenizer.special_ids((tags.open, tags.close))


@dataclass
class Reasoning:
    """How a request's answers are split: whether each starts inside a think block, the tags,
    and the tags' special tokens (the counter's decode keeps them)."""

    inside: bool
    tags: Tags = THINK
    shown: frozenset[int] = frozenset()

    def splitter(self) -> ThinkSplitter:
        return ThinkSplitter(self.inside, self.tags)

    def counter(self, tokenizer: TextTokenizer) -> ThinkCounter:
        return ThinkCounter(tokenizer, self.inside, self.tags, self.shown)

    def split(self, text: str) -> tuple[str | None, str]:
        """A whole answer's (reasoning or None, content)."""
        splitter = self.splitter()
        thought, content = splitter.feed(text)
        more, rest = splitter.finish()
        return (thought + more) if splitter.opened else None, content + rest


# ThinkSplitter's states
START, INSIDE, CLOSED, CONTENT = "start", "inside", "closed", "content"


def _partial_tag(text: str, tag: str) -> int:
    """How many characters at the end of `text` could begin `tag`."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-size:]):
            return size
    return 0


class ThinkSplitter:
    """A streamed answer's text as (reasoning, content) pieces."""

    def __init__(self, inside: bool, tags: Tags = THINK):
        self.tags = tags
        self.state = INSIDE if inside else START
        self.opened = inside  # a think block was opened: the answer has reasoning (maybe empty)
        self.held = ""  # at most a partial tag, or the leading whitespace

    def feed(self, piece: str) -> tuple[str, str]:
        """(reasoning, content) of the answer so far that can go out now."""
        text, self.held = self.held + piece, ""
        thought: list[str] = []
        content: list[str] = []
        while text:
            if self.state == START:
                stripped = text.lstrip()
                if stripped.startswith(self.tags.open):
                    self.state, self.opened, text = INSIDE, True, stripped[len(self.tags.open) :]
                elif self.tags.open.startswith(stripped) and len(text) - len(stripped) <= MAX_LEADING_SPACE:
                    self.held = text  # whitespace, maybe the beginning of the tag: wait
                    break
                else:
                    self.state = CONTENT
            elif self.state == INSIDE:
                end = text.find(self.tags.close)
                if end >= 0:
                    thought.append(text[:end])
                    self.state, text = CLOSED, text[end + len(self.tags.close) :]
                else:
                    keep = _partial_tag(text, self.tags.close)
                    thought.append(text[: len(text) - keep])
                    self.held = text[len(text) - keep :]
                    break
            elif self.state == CLOSED:  # the whitespace between the block and the answer is dropped
                text = text.lstrip()
                if text:
                    self.state = CONTENT
            else:
                content.append(text)
                break
        return "".join(thought), "".join(content)

    def finish(self) -> tuple[str, str]:
        """What was held back, at the answer's end: a partial end tag is reasoning, the rest content."""
        held, self.held = self.held, ""
        return (held, "") if self.state == INSIDE else ("", held)


class ThinkCounter:
    """The answer tokens spent thinking (usage's reasoning_tokens): those up to and including the
    one that completes the end tag; all of an answer cut while thinking; none of one that does not
    think. Counted on token ids, each detokenized once as the answer's text is (linear), until the
    block ends."""

    def __init__(
        self, tokenizer: TextTokenizer, inside: bool, tags: Tags = THINK, shown: frozenset[int] = frozenset()
    ):
        self.detokenizer = IncrementalDetokenizer(tokenizer, shown)
        self.splitter = ThinkSplitter(inside, tags)
        self.seen = 0  # tokens read while the answer may still be thinking

    def feed(self, ids: list[int]) -> None:
        for token in ids:
            if self.splitter.state in (CLOSED, CONTENT):
                return
            self.seen += 1
            self.splitter.feed(self.detokenizer.add(token))

    @property
    def tokens(self) -> int:
        return self.seen if self.splitter.opened else 0
