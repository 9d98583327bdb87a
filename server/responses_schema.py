"""Request bodies of OpenAI's Responses API (/v1/responses), and their translation into the chat
request the server serves (server/openai_schema.py's ChatCompletionRequest): input items become
chat messages (function calls an assistant's `tool_calls`, their outputs `tool` messages),
`instructions` a system message, function tools chat tools, `text.format` a `response_format`;
reasoning items (a reasoning model's past thinking) are dropped, as its template drops past
thinking. What the server cannot honour (built-in tools, background mode, `reasoning` on a model
that does not reason, reasoning effort levels, sampling parameters the chat request would not
carry, ...) is refused by `unsupported()` with a message naming it."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from agent.contract.sampling import CacheSalt
from server.openai_schema import MAX_MESSAGES, refused_sampling

# The text content parts a message may hold; images, files and audio are refused.
TEXT_PARTS = ("input_text", "output_text", "text", "refusal")
ITEM_TYPES = ("message", "function_call", "function_call_output", "reasoning")
REASONING_SUMMARIES = ("auto", "concise", "detailed")
# OpenAI's bounds on `metadata`, which a kept response holds and echoes; and on `user`.
MAX_METADATA_KEYS, MAX_METADATA_KEY_CHARS, MAX_METADATA_VALUE_CHARS = 16, 64, 512
MAX_USER_CHARS = 256


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: str
    text: str | None = None
    refusal: str | None = None


Content = str | list[ContentPart]


def content_text(content: Content | None) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    return "".join(part.text or part.refusal or "" for part in content)


class InputItem(BaseModel):
    """A message (`role`, `content`), a function call or a function call's output."""

    model_config = ConfigDict(extra="allow")

    type: str = "message"
    role: Literal["user", "assistant", "system", "developer"] | None = None
    content: Content | None = None
    call_id: str | None = None
    name: str | None = None
    arguments: str | None = None
    output: Content | None = None


class TextFormat(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict | None = Field(None, alias="schema")
    strict: bool | None = None
    description: str | None = None


class TextConfig(BaseModel):
    model_config = ConfigDict(extra="allow")

    format: TextFormat | None = None


class NamedFunction(BaseModel):
    type: str
    name: str | None = None


class ResponsesRequest(BaseModel):
    # Unknown fields are accepted (clients send extras); the known ones the server cannot honour
    # are refused by unsupported().
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    model: str
    input: str | Annotated[list[InputItem], Field(max_length=MAX_MESSAGES)] = Field(default_factory=list)
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    # vLLM's and llama.cpp's, carried to the chat request (and checked there)
    min_p: float | None = None
    typical_p: float | None = None
    tools: list[dict] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    stream: bool = False
    previous_response_id: str | None = None
    store: bool | None = None
    metadata: dict[str, str] | None = Field(None, max_length=MAX_METADATA_KEYS)
    user: str | None = Field(None, max_length=MAX_USER_CHARS)
    # This server's chat extensions, passed on as /v1/chat/completions takes them (and checks them
    # there: a bad value is a 400 naming it).
    cache_salt: CacheSalt | None = None
    priority: int | None = None
    speculate: bool | None = None
    chat_template_kwargs: dict | None = None
    # Refused when they ask for something (unsupported()).
    background: bool | None = None
    conversation: str | dict | None = None
    prompt: dict | None = None
    reasoning: dict | None = None
    include: list[str] | None = None
    top_logprobs: int | None = None
    truncation: Literal["auto", "disabled"] | None = None
    max_tool_calls: int | None = None

    @field_validator("metadata")
    @classmethod
    def _metadata_bounds(cls, metadata: dict[str, str] | None) -> dict[str, str] | None:
        for key, value in (metadata or {}).items():
            if len(key) > MAX_METADATA_KEY_CHARS:
                raise ValueError(f"metadata keys have at most {MAX_METADATA_KEY_CHARS} characters")
            if len(value) > MAX_METADATA_VALUE_CHARS:
                raise ValueError(
                    f"metadata values have at most {MAX_METADATA_VALUE_CHARS} characters ({key[:20]!r})"
                )
        return metadata

    @property
    def keeps(self) -> bool:
        """The response is stored for previous_response_id (OpenAI's default)."""
        return self.store is not False

    def items(self) -> list[InputItem]:
        if isinstance(self.input, str):
            return [InputItem(role="user", content=self.input)]
        return self.input

    def unsupported(self, reasons: bool = False) -> str | None:
        """The first field this server cannot honour, as a message naming it; None if all are fine.
        `reasons`: the model thinks aloud (server/reasoning.py)."""
        sampling = refused_sampling(self, "/v1/responses")
        refused = [
            (sampling is not None, sampling or ""),
            (self.background, "background mode (background: true) is not supported"),
            (self.conversation, "conversation is not supported: chain responses with previous_response_id"),
            (self.prompt, "prompt (reusable prompt templates) is not supported"),
            (self.include, f"include is not supported ({', '.join(self.include or [])})"),
            (
                self.top_logprobs,
                "top_logprobs is not supported on /v1/responses (it is on /v1/chat/completions)",
            ),
            (self.truncation == "auto", "truncation 'auto' is not supported (the prompt is never cut)"),
            (self.max_tool_calls is not None, "max_tool_calls is not supported"),
        ]
        refused.append(
            (self.reasoning_asked and not reasons, "reasoning is not supported (this model does not reason)")
        )
        for key, value in (self.reasoning or {}).items():
            if key == "summary" and value not in (None, *REASONING_SUMMARIES):
                refused.append((True, f"reasoning.summary must be one of {', '.join(REASONING_SUMMARIES)}"))
            elif key not in ("summary", "max_tokens") and value is not None:
                # effort levels: the model thinks as long as it does (max_tokens bounds its thinking,
                # checked with the translated chat request's max_thinking_tokens)
                refused.append(
                    (True, f"reasoning.{key} is not supported (reasoning.summary and max_tokens are)")
                )
        for n, tool in enumerate(self.tools or []):
            if tool.get("type") != "function":
                kind = tool.get("type")
                refused.append(
                    (True, f"tools[{n}]: built-in tools ({kind!r}) are not supported, function tools are")
                )
        if isinstance(self.tool_choice, NamedFunction) and self.tool_choice.type != "function":
            refused.append((True, f"tool_choice of type {self.tool_choice.type!r} is not supported"))
        for i, item in enumerate(self.items()):
            if item.type not in ITEM_TYPES:
                refused.append((True, f"input[{i}]: items of type {item.type!r} are not supported"))
            if item.type == "reasoning":
                continue  # dropped: its reasoning_text parts are not read
            for part in [*_parts(item.content), *_parts(item.output)]:
                if part.type not in TEXT_PARTS:
                    refused.append(
                        (True, f"input[{i}]: content of type {part.type!r} is not supported (text is)")
                    )
        return next((message for asked, message in refused if asked), None)

    @property
    def reasoning_asked(self) -> bool:
        return bool(self.reasoning) and any(v is not None for v in (self.reasoning or {}).values())

    def echoed_reasoning(self) -> dict:
        """`reasoning` as a response echoes it."""
        return {"effort": None, "summary": (self.reasoning or {}).get("summary")}

    def chat_tools(self) -> list[dict] | None:
        if not self.tools:
            return None
        keys = ("name", "description", "parameters", "strict")
        return [
            {"type": "function", "function": {k: t[k] for k in keys if t.get(k) is not None}}
            for t in self.tools
        ]

    def echoed_tool_choice(self) -> str | dict:
        """`tool_choice` as a response echoes it."""
        if isinstance(self.tool_choice, NamedFunction):
            return self.tool_choice.model_dump(exclude_none=True)
        return self.tool_choice or ("auto" if self.tools else "none")

    def chat_tool_choice(self) -> str | dict | None:
        if isinstance(self.tool_choice, NamedFunction):
            return {"type": "function", "function": {"name": self.tool_choice.name}}
        return self.tool_choice

    def response_format(self) -> dict | None:
        fmt = self.text.format if self.text else None
        if fmt is None or fmt.type == "text":
            return None
        if fmt.type == "json_object":
            return {"type": "json_object"}
        schema = {"name": fmt.name, "schema": fmt.schema_ or {}, "strict": fmt.strict}
        return {"type": "json_schema", "json_schema": {k: v for k, v in schema.items() if v is not None}}

    def text_config(self) -> dict:
        """`text` as a response echoes it."""
        fmt = self.text.format if self.text and self.text.format else None
        return {"format": fmt.model_dump(by_alias=True, exclude_none=True) if fmt else {"type": "text"}}


def _parts(content: Content | None) -> list[ContentPart]:
    return [] if content is None or isinstance(content, str) else content


def chat_messages(items: list[InputItem]) -> list[dict]:
    """Input items as chat messages: a function call joins the assistant message before it (or
    starts one), its output becomes a `tool` message."""
    messages: list[dict] = []
    for item in items:
        if item.type == "function_call":
            call = {
                "id": item.call_id,
                "type": "function",
                "function": {"name": item.name, "arguments": item.arguments or "{}"},
            }
            if messages and messages[-1]["role"] == "assistant":
                messages[-1]["tool_calls"] = [*(messages[-1].get("tool_calls") or []), call]
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif item.type == "reasoning":
            continue
        elif item.type == "function_call_output":
            messages.append(
                {"role": "tool", "tool_call_id": item.call_id, "content": content_text(item.output)}
            )
        else:
            messages.append({"role": item.role or "user", "content": content_text(item.content)})
    return messages
