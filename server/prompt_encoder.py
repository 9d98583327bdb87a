"""PromptEncoder: prompt text (or a conversation) -> token ids without stalling the event loop: short
prompts on the loop, long ones and every chat template's rendering in a small thread pool, a prompt
of more characters than the longest accepted prompt could hold refused before any work."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from agent.model.chat_template import RenderBudgetError
from agent.model.tokenizer import TextTokenizer, TokenizerError
from scheduler.engine import Engine
from server.errors import ApiError

# Prompts up to this many characters are tokenized on the event loop (well under a millisecond);
# longer ones in a small pool, where a flood of big prompts queues instead of stalling every stream.
INLINE_PROMPT_CHARS = 4096
TOKENIZER_THREADS = 2


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
        return self.engine.max_prompt_len

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
