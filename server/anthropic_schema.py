"""Request bodies of Anthropic's Messages API (/v1/messages, /v1/messages/count_tokens), and their
translation into the chat request the server serves: `system` a system message, text blocks
content parts, an assistant's `tool_use` blocks its `tool_calls`, a user's `tool_result` blocks
`tool` messages, `tools` function tools, `tool_choice` the chat's (any: required). `thinking` is
served by a reasoning model (server/reasoning.py: its thinking comes back as `thinking` blocks;
`disabled` sets the template's enable_thinking false, as Qwen3's takes it); an assistant's past
thinking blocks are dropped, as the reasoning models' templates drop past thinking. What the server
cannot honour (images, documents, thinking on a model that does not reason, server tools, MCP
servers, sampling parameters the chat request would not carry) is refused by `unsupported()` with a
message naming it."""

from __future__ import annotations

import json
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from agent.contract.sampling import CacheSalt
from server.openai_schema import MAX_MESSAGES, refused_sampling

SERVED_BLOCKS = {
    "user": ("text", "tool_result"),
    "assistant": ("text", "tool_use", "thinking", "redacted_thinking"),
}
THINKING_TYPES = ("enabled", "adaptive", "disabled")


class Block(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: str
    text: str | None = None
    id: str | None = None  # tool_use
    name: str | None = None
    input: dict | None = None
    tool_use_id: str | None = None  # tool_result
    content: str | list[Block] | None = None
    is_error: bool | None = None


def blocks_text(content: str | list[Block] | None) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    return "".join(block.text or "" for block in content if block.type == "text")


class Message(BaseModel):
    role: Literal["user", "assistant"]
    content: str | list[Block]


class ToolDefinition(BaseModel):
    model_config = ConfigDict(extra="allow")

    name: str
    type: str | None = None  # "custom" or none; server tools (web_search_..., bash_...) are refused
    description: str | None = None
    input_schema: dict = Field(default_factory=lambda: {"type": "object", "properties": {}})


class ToolChoice(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool = False


class OutputFormat(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: Literal["json_schema"]
    schema_: dict = Field(alias="schema")


class OutputConfig(BaseModel):
    """Structured output (`format`: a JSON Schema the answer follows); `effort` is refused."""

    model_config = ConfigDict(extra="allow")

    effort: str | None = None
    format: OutputFormat | None = None

    def response_format(self) -> dict | None:
        if self.format is None:
            return None
        return {"type": "json_schema", "json_schema": {"name": "output", "schema": self.format.schema_}}


class CountTokensRequest(BaseModel):
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    model: str
    messages: list[Message] = Field(min_length=1, max_length=MAX_MESSAGES)
    system: str | list[Block] | None = None
    tools: list[ToolDefinition] | None = None
    tool_choice: ToolChoice | None = None
    thinking: dict | None = None
    mcp_servers: list | None = None
    # vLLM's chat_template_kwargs, passed on as /v1/chat/completions takes them (checked there)
    chat_template_kwargs: dict | None = None

    def unsupported(self, reasons: bool = False) -> str | None:
        """The first thing asked that this server cannot honour, as a message naming it; `reasons`:
        the model thinks aloud (server/reasoning.py)."""
        kind = (self.thinking or {}).get("type")
        if self.thinking and kind not in THINKING_TYPES:
            return f"thinking.type must be one of {', '.join(THINKING_TYPES)}"
        if self.thinking and kind != "disabled" and not reasons:
            return "thinking is not supported (this model does not think aloud)"
        if self.mcp_servers:
            return "mcp_servers is not supported"
        for n, tool in enumerate(self.tools or []):
            if tool.type not in (None, "custom"):
                return f"tools.{n}: server tools ({tool.type!r}) are not supported, client tools are"
        for i, message in enumerate(self.messages):
            blocks = [] if isinstance(message.content, str) else message.content
            for j, block in enumerate(blocks):
                where = f"messages.{i}.content.{j}"
                if block.type not in SERVED_BLOCKS[message.role]:
                    return f"{where}: {block.type!r} blocks are not supported in {message.role} messages"
                if block.type == "tool_result" and not isinstance(block.content, str | None):
                    kinds = sorted({b.type for b in block.content or []} - {"text"})
                    if kinds:
                        return f"{where}: tool results of {', '.join(kinds)} are not supported (text is)"
        return None

    def chat_fields(self) -> dict:
        """The chat request's fields for this conversation and its tools."""
        messages: list[dict] = []
        if self.system:
            messages.append({"role": "system", "content": blocks_text(self.system)})
        for message in self.messages:
            messages += chat_messages(message)
        choice, parallel = self.tool_choice, None
        if choice is not None and choice.disable_parallel_tool_use:
            parallel = False
        kwargs = self.chat_template_kwargs
        if (self.thinking or {}).get("type") == "disabled":  # Qwen3's switch; other templates ignore it
            kwargs = {"enable_thinking": False, **(kwargs or {})}
        return {
            "model": self.model,
            "chat_template_kwargs": kwargs,
            "messages": messages,
            "tools": [
                {
                    "type": "function",
                    "function": {"name": t.name, "description": t.description, "parameters": t.input_schema},
                }
                for t in self.tools or []
            ]
            or None,
            "tool_choice": None if choice is None else chat_tool_choice(choice),
            "parallel_tool_calls": parallel,
        }


class MessagesRequest(CountTokensRequest):
    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = None
    temperature: float | None = Field(None, ge=0.0, le=1.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0)
    # vLLM's and llama.cpp's, carried to the chat request (and checked there)
    min_p: float | None = None
    typical_p: float | None = None
    stream: bool = False
    metadata: dict | None = None
    container: str | dict | None = None
    output_config: OutputConfig | None = None
    # This server's chat extensions (the `anthropic` package sends them through extra_body),
    # passed on as /v1/chat/completions takes them and checked there: a bad value is a 400.
    cache_salt: CacheSalt | None = None
    priority: int | None = None
    speculate: bool | None = None

    def unsupported(self, reasons: bool = False) -> str | None:
        if self.container:
            return "container is not supported"
        if self.output_config and self.output_config.effort is not None:
            return "output_config.effort is not supported (no effort levels: thinking runs as the model does)"
        return refused_sampling(self, "/v1/messages") or super().unsupported(reasons)

    def chat_fields(self) -> dict:
        return {
            **super().chat_fields(),
            "max_tokens": self.max_tokens,
            "stop": self.stop_sequences,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "min_p": self.min_p,
            "typical_p": self.typical_p,
            "user": (self.metadata or {}).get("user_id"),
            "response_format": self.output_config.response_format() if self.output_config else None,
            "cache_salt": self.cache_salt,
            "priority": self.priority,
            "speculate": self.speculate,
            # enforced (server/thinking_budget.py); "adaptive" thinking has no budget
            "max_thinking_tokens": self.thinking.get("budget_tokens")
            if self.thinking and self.thinking.get("type") == "enabled"
            else None,
        }


def chat_tool_choice(choice: ToolChoice) -> str | dict:
    if choice.type == "tool":
        return {"type": "function", "function": {"name": choice.name or ""}}
    return {"auto": "auto", "any": "required", "none": "none"}[choice.type]


def chat_messages(message: Message) -> list[dict]:
    """One Anthropic message as chat messages: a user's tool results first (each a `tool` message),
    then its text; an assistant's text with its tool uses as `tool_calls`."""
    if isinstance(message.content, str):
        return [{"role": message.role, "content": message.content}]
    out: list[dict] = []
    texts = [{"type": "text", "text": b.text or ""} for b in message.content if b.type == "text"]
    if message.role == "assistant":
        calls = [
            {
                "id": b.id,
                "type": "function",
                "function": {"name": b.name, "arguments": json.dumps(b.input or {}, ensure_ascii=False)},
            }
            for b in message.content
            if b.type == "tool_use"
        ]
        return [{"role": "assistant", "content": texts or None, "tool_calls": calls or None}]
    for block in message.content:
        if block.type == "tool_result":
            result = blocks_text(block.content)
            out.append(
                {
                    "role": "tool",
                    "tool_call_id": block.tool_use_id,
                    "content": "Error: " + result if block.is_error else result,
                }
            )
    if texts or not out:
        out.append({"role": "user", "content": texts})
    return out
