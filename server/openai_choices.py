"""The reply context of an admitted OpenAI-style request (Choices: the request, its model, prompt and
answer streams, and how its choices are shaped), and the readers of its streams: what a stream may
show now (text that may still be a tool call or a think tag waits), and the one choice of a
translated request (Responses, Anthropic's Messages) whole or in pieces."""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field

from agent.contract.prompt_logprobs import PromptLogprob
from server import reasoning, tool_calls
from server.collect import collected, merged
from server.model_repository import LoadedModel
from server.openai_schema import ChatCompletionRequest, CompletionRequest
from server.output import AnswerStream, GeneratedToken, GenerationOutput

CREATED = int(time.time())

OpenAIRequest = CompletionRequest | ChatCompletionRequest


@dataclass
class Choices:
    """One admitted request's context: what it asked, of which model, and its choices' streams."""

    req: OpenAIRequest
    model: LoadedModel
    prompt: list[int]
    streams: list[AnswerStream]
    chat: bool
    top: int | None  # the top logprobs asked for (None: no logprobs)
    calls: bool  # the answers are read for tool calls
    reply_id: str = ""
    offsets: list[int] = field(default_factory=list)  # completions: characters of each choice so far
    prompts: list[list[int]] = field(default_factory=list)  # each choice's prompt (default: `prompt`)
    echoes: list[str] = field(default_factory=list)  # completions' echo: each choice's prompt text
    hidden: bool = False  # max_tokens 0: the one token the engine generates is not shown
    usage_prompt: int | None = None  # prompt tokens of all prompts (default: `prompt`'s)
    call_format: str = tool_calls.HERMES  # the model's tool call format (tool_calls.call_format)
    thinks: reasoning.Reasoning | None = None  # chats of a reasoning model: its thinking read apart
    counters: dict[int, reasoning.ThinkCounter] = field(default_factory=dict)  # each choice's thinking

    def __post_init__(self) -> None:
        self.reply_id = ("chatcmpl-" if self.chat else "cmpl-") + uuid.uuid4().hex
        self.offsets = [0] * len(self.streams)
        self.prompts = self.prompts or [self.prompt] * len(self.streams)

    @property
    def echo(self) -> bool:
        return isinstance(self.req, CompletionRequest) and self.req.echo

    def envelope(self, choices: list[dict], chunk: bool) -> dict:
        name = "chat.completion" if self.chat else "text_completion"
        return {
            "id": self.reply_id,
            "object": name + (".chunk" if chunk and self.chat else ""),
            "created": int(time.time()),
            "model": self.req.model,
            "choices": choices,
        }

    def usage(self, completion_tokens: int) -> dict:
        prompt = len(self.prompt) if self.usage_prompt is None else self.usage_prompt
        completion_tokens = 0 if self.hidden else completion_tokens
        usage: dict = {
            "prompt_tokens": prompt,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt + completion_tokens,
        }
        if self.chat:
            usage["completion_tokens_details"] = {"reasoning_tokens": self.reasoning_tokens()}
        return usage

    def count_thinking(self, i: int, out: GenerationOutput) -> None:
        """Choice i's output read for the tokens it spends thinking (a model that reasons)."""
        if self.thinks is not None:
            if i not in self.counters:
                self.counters[i] = self.thinks.counter(self.model.tokenizer)
            self.counters[i].feed([t.id for t in out.tokens])

    def reasoning_tokens(self) -> int:
        """The tokens all choices spent thinking so far (count_thinking)."""
        return 0 if self.hidden else sum(c.tokens for c in self.counters.values())

    def watcher(self) -> tool_calls.CallWatcher | None:
        """What holds back a streamed choice's text that may be a tool call (None: no tools)."""
        if not self.calls:
            return None
        assert isinstance(self.req, ChatCompletionRequest)  # only chats are read for calls
        return tool_calls.CallWatcher(self.req.tools or [], self.req.parallel_tool_calls, self.call_format)

    def split_calls(self, text: str) -> tuple[str | None, list[dict]]:
        """A whole choice's text outside tool calls, and its calls (none where none were asked)."""
        if not self.calls:
            return text, []
        assert isinstance(self.req, ChatCompletionRequest)
        return tool_calls.parse_calls(
            text, self.req.tools or [], self.req.parallel_tool_calls, self.call_format
        )

    def splitter(self) -> reasoning.ThinkSplitter | None:
        """What reads a streamed choice's thinking apart (None: the model does not reason)."""
        return self.thinks.splitter() if self.thinks else None

    def thought(self, text: str) -> tuple[str | None, str]:
        """A whole choice's reasoning (None: none) and the rest of its text."""
        return self.thinks.split(text) if self.thinks else (None, text)

    def logprobs(self, i: int, tokens: list[GeneratedToken]) -> dict | None:
        """Choice i's logprobs of these tokens (its next ones), if the request asked."""
        if self.top is None:
            return None
        if self.chat:
            return {"content": self.model.formatter.chat(tokens)}
        shown = self.model.formatter.completion(tokens, self.offsets[i])
        self.offsets[i] += sum(map(len, shown["tokens"]))
        return shown

    def shown(self, i: int, out: GenerationOutput) -> tuple[str, list[GeneratedToken]]:
        """The output's text and tokens as choice i shows them (none with max_tokens 0)."""
        return ("", []) if self.hidden else (out.text, out.tokens)

    def prompt_part(self, i: int, entries: tuple[PromptLogprob, ...] | None) -> tuple[str, dict | None, dict]:
        """What choice i shows of its prompt, before its first text: the echoed text, its echo
        logprobs (its generated tokens' text offsets follow them) and its vLLM `prompt_logprobs`
        field where asked (`entries`: the engine's, positions 1..)."""
        ids, scored, formatter = self.prompts[i], list(entries or ()), self.model.formatter
        extra = {}
        asked = self.req.prompt_logprobs
        if asked is not None:
            extra["prompt_logprobs"] = formatter.vllm_prompt(ids, scored, asked)
        if not self.echo:
            return "", None, extra
        if self.top is None:
            return self.echoes[i], None, extra
        shown = formatter.echo(ids, scored, self.top)
        self.offsets[i] = sum(map(len, shown["tokens"]))
        return self.echoes[i], shown, extra


Reader = tuple[reasoning.ThinkSplitter | None, tool_calls.CallWatcher | None]


def held(reader: Reader, out: GenerationOutput) -> tuple[str, str, list[dict]]:
    """The output's reasoning and text that may go out now (text that may be a tag waits) and, at
    the choice's end, its tool calls (`reader`: the choice's Choices.splitter and .watcher)."""
    splitter, watcher = reader
    if out.error:
        return "", out.text, []
    thought, text = ("", out.text) if splitter is None else splitter.feed(out.text)
    if splitter is not None and out.finished:
        more, rest = splitter.finish()
        thought, text = thought + more, text + rest
    if watcher is None:
        return thought, text, []
    text = watcher.feed(text)
    if not out.finished:
        return thought, text, []
    rest, calls = watcher.finish()
    return thought, text + rest, calls


@dataclass
class WholeChoice:
    """A translated request's one choice, read to its end."""

    content: str | None  # the text outside tool calls (the whole text when none was asked for)
    calls: list[dict]  # its tool calls in OpenAI's shape
    tokens: int  # generated tokens (an EOS that ended it included)
    finish_reason: str | None
    stop_sequence: str | None  # the stop string that ended it
    reasoning: str | None = None  # a reasoning model's thinking


async def whole_choice(answer: Choices) -> WholeChoice:
    texts: list[str] = []
    last = None
    async with contextlib.aclosing(collected(answer.streams)) as outputs:
        async for i, out in outputs:
            answer.count_thinking(i, out)
            texts.append(out.text)
            last = out
    assert last is not None  # a stream ends with a finished output
    thought, text = answer.thought("".join(texts))
    content, calls = answer.split_calls(text)
    return WholeChoice(content, calls, last.index, last.finish_reason, last.stop_sequence, thought)


@dataclass
class ChoicePiece:
    text: str  # what may go out now (text that could be a tool call is held back)
    out: GenerationOutput  # the output it came from: finished, finish_reason, index, error ...
    calls: list[dict]  # at the end: the answer's tool calls
    reasoning: str = ""  # a reasoning model's thinking that may go out now


async def choice_pieces(answer: Choices) -> AsyncGenerator[ChoicePiece]:
    """A translated request's one choice as it streams; closing this aborts it."""
    reader = (answer.splitter(), answer.watcher())
    async with contextlib.aclosing(merged(answer.streams)) as outputs:
        async for i, out in outputs:
            answer.count_thinking(i, out)
            thought, text, calls = held(reader, out)
            yield ChoicePiece(text, out, calls, thought)
