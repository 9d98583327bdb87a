"""Request bodies of the OpenAI-compatible API. Parameters the server cannot honour are refused by
`unsupported()` with a message naming them, never silently ignored: the sampling parameters other
servers take and no sampler here implements among them (agent/contract/sampling.py's
UNSERVED_SAMPLING, whichever API they come to). Other unknown fields (what SDKs and clients send
beside the request) are accepted."""

from __future__ import annotations

import json
from typing import Annotated, Literal, Self

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from agent.contract.sampling import (
    MAX_LOGPROBS,
    MAX_PENALTY,
    MAX_PRIORITY,
    MAX_REPETITION_PENALTY,
    MAX_SEED,
    MAX_TOP_K,
    MIN_REPETITION_PENALTY,
    CacheSalt,
    LogitBias,
    SamplingParams,
    StopTokenIds,
    check_stop_strings,
    unserved_sampling,
)
from server.request_body import json_value
from server.structured_output import GrammarError, GrammarSpec
from server.template_kwargs import check_template_kwargs

MAX_N = 8  # completions per request; each is one more sequence in the batch
# A conversation's messages (Anthropic's, Responses' input items): each is validated, converted and
# rendered before the prompt's length is known; the longest prompt bounds them again per model
# (server/prompt_encoder.py). 50,000 empty messages fit in a 1 MB body.
MAX_MESSAGES = 4096
MAX_CHOICES = 256  # structured_outputs.choice
MAX_TOKEN_ID_DIGITS = 10  # logit_bias keys: token ids are int32


def json_text(value: dict | str) -> str:
    """A JSON Schema as canonical JSON text (the grammar cache's key); a string must hold JSON."""
    if isinstance(value, str):
        try:
            value = json_value(value)
        except ValueError as exc:
            raise GrammarError(f"the schema is not JSON: {exc}") from exc
    return json.dumps(value, separators=(",", ":"))  # its order kept: properties are generated in it


class StructuredOutputs(BaseModel):
    """vLLM's `structured_outputs` (the form this server documents): exactly one of them."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    json_schema: dict | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = Field(None, min_length=1, max_length=MAX_CHOICES)
    grammar: str | None = None  # Lark

    @model_validator(mode="after")
    def _exactly_one(self) -> Self:
        given = [
            name for name in ("json_schema", "regex", "choice", "grammar") if getattr(self, name) is not None
        ]
        if len(given) != 1:
            raise ValueError("structured_outputs takes exactly one of json, regex, choice, grammar")
        return self

    def spec(self) -> GrammarSpec:
        if self.json_schema is not None:
            return GrammarSpec("json", json_text(self.json_schema))
        if self.regex is not None:
            return GrammarSpec("regex", self.regex)
        if self.choice is not None:
            return GrammarSpec("choice", json.dumps(self.choice))
        assert self.grammar is not None
        return GrammarSpec("lark", self.grammar)


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="allow")

    name: str | None = None
    json_schema: dict = Field(alias="schema")
    strict: bool | None = None  # the schema is always enforced


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> Self:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("json_schema is given with type json_schema, and only then")
        return self

    def spec(self) -> GrammarSpec | None:
        if self.type == "json_object":
            return GrammarSpec("json_object", "")
        if self.json_schema is not None:
            return GrammarSpec("json", json_text(self.json_schema.json_schema))
        return None


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Common(BaseModel):
    # Unknown fields are accepted (the SDK and other clients send extras), except sampling
    # parameters no sampler here implements (unsupported()); known ones are checked.
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    n: int = Field(1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: list[str] = Field(default_factory=list)  # a string or a list on the wire
    seed: int | None = Field(None, ge=0, le=MAX_SEED)
    presence_penalty: float = Field(0.0, ge=-MAX_PENALTY, le=MAX_PENALTY)
    frequency_penalty: float = Field(0.0, ge=-MAX_PENALTY, le=MAX_PENALTY)
    logit_bias: LogitBias = ()  # a map token id -> bias on the wire
    user: str | None = None
    # Extensions vLLM and llama.cpp accept too.
    top_k: int = Field(0, ge=0, le=MAX_TOP_K)
    min_p: float = Field(0.0, ge=0.0, le=1.0)  # 0: off
    typical_p: float = Field(1.0, gt=0.0, le=1.0)  # 1: off
    repetition_penalty: float = Field(1.0, ge=MIN_REPETITION_PENALTY, le=MAX_REPETITION_PENALTY)
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)
    stop_token_ids: StopTokenIds = ()
    structured_outputs: StructuredOutputs | None = None
    # vLLM's: prefix-cache blocks shared only with requests of the same salt
    cache_salt: CacheSalt | None = None
    priority: int = Field(0, ge=-MAX_PRIORITY, le=MAX_PRIORITY)
    speculate: bool = True  # false: no tokens proposed for it (runtime.speculation)

    def grammar_spec(self) -> GrammarSpec | None:
        """The grammar the answer must follow, if any (GrammarError for a JSON text that is not)."""
        return self.structured_outputs.spec() if self.structured_outputs else None

    @field_validator("stop_token_ids", mode="before")
    @classmethod
    def _null_stop_token_ids(cls, value):
        return () if value is None else value

    @field_validator("logit_bias", mode="before")
    @classmethod
    def _bias_map(cls, value):
        """OpenAI's map (token id as a JSON key -> bias) as the (id, bias) pairs SamplingParams
        takes; their bounds are LogitBias' rule."""
        if value is None:
            return ()
        if not isinstance(value, dict):
            raise ValueError("logit_bias maps token ids to biases (a JSON object)")
        for key in value:
            # ASCII digits of an int32: int() of 5000 digits raises past Python's digit limit, and
            # isdecimal() alone admits other scripts' digits
            if not (key.isascii() and key.isdigit() and len(key) <= MAX_TOKEN_ID_DIGITS):
                raise ValueError(
                    f"logit_bias keys are token ids, got {key[:20]!r}{'...' if len(key) > 20 else ''}"
                )
        return tuple((int(key), bias) for key, bias in value.items())

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_list(cls, value):
        if value is None:
            return []
        return [value] if isinstance(value, str) else value

    @field_validator("stop")
    @classmethod
    def _stop_bounds(cls, value: list[str]) -> list[str]:
        return check_stop_strings(value)

    @model_validator(mode="after")
    def _seeds_of_every_choice_fit(self) -> Self:
        # Choice i samples with seed + i: each must be a valid seed, or choice 0 would be admitted
        # before choice 1 is refused.
        if self.seed is not None and self.seed + self.n - 1 > MAX_SEED:
            raise ValueError(f"seed + n - 1 must be at most {MAX_SEED} (choice i samples with seed + i)")
        return self

    def unsupported(self) -> str | None:
        """The first parameter this server cannot honour, as a message; None if all are fine."""
        if self.presence_penalty < 0 or self.frequency_penalty < 0:
            return "negative presence_penalty/frequency_penalty are not supported (0 to 2 are)"
        return unserved_sampling(request_fields(self), type(self).model_fields)


def request_fields(request: BaseModel) -> dict:
    """A request's fields by name, the unknown ones (pydantic's extra) too."""
    return {**request.__dict__, **(request.model_extra or {})}


# The sampler's parameters (SamplingParams') as the chat API takes them: an API that translates into
# a chat request and does not carry one (Responses, Anthropic's) refuses it by name.
CHAT_SAMPLING = frozenset(SamplingParams.model_fields) - {"do_sample", "logprobs", "prompt_logprobs"}


def refused_sampling(request: BaseModel, api: str) -> str | None:
    """The sampling parameters `request` (of the API at path `api`) asks for and its API does not
    serve, as a message naming them: those no sampler here implements, then the chat API's own."""
    fields, served = request_fields(request), type(request).model_fields
    problem = unserved_sampling(fields, served)
    elsewhere = [n for n, v in fields.items() if n in CHAT_SAMPLING and n not in served and v is not None]
    if problem or not elsewhere:
        return problem
    one = len(elsewhere) == 1
    return (
        f"{', '.join(elsewhere)} {'is' if one else 'are'} not supported on {api} "
        f"(/v1/chat/completions takes {'it' if one else 'them'})"
    )


# A prompt given as token ids: bounded here only against absurd bodies; the longest prompt the
# agents take is the engine's bound (413), and each id is checked against the vocabulary (400).
MAX_PROMPT_IDS = 1 << 20
TokenIds = Annotated[list[int], Field(min_length=1, max_length=MAX_PROMPT_IDS)]
# Prompts in one completions request (OpenAI's list of prompts): each is n more sequences.
MAX_PROMPTS = 16
MAX_PROMPT_CHOICES = 64  # prompts x n


class CompletionRequest(_Common):
    # one prompt (text or token ids) or a list of them: one choice per prompt (n each), in order
    prompt: (
        str
        | TokenIds
        | Annotated[list[str], Field(min_length=1, max_length=MAX_PROMPTS)]
        | Annotated[list[TokenIds], Field(min_length=1, max_length=MAX_PROMPTS)]
    )
    # OpenAI's default for completions; 0 with echo or prompt_logprobs: the prompt's logprobs alone
    max_tokens: int | None = Field(16, ge=0)
    echo: bool = False  # the prompt (with its logprobs, where asked) before each choice's text
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)  # vLLM's
    best_of: int | None = None
    suffix: str | None = None

    @model_validator(mode="after")
    def _prompts_bounded(self) -> Self:
        if len(self.prompts) * self.n > MAX_PROMPT_CHOICES:
            raise ValueError(f"prompts x n must be at most {MAX_PROMPT_CHOICES} choices")
        if self.max_tokens == 0 and not self.echo and self.prompt_logprobs is None:
            raise ValueError("max_tokens 0 answers nothing: send it with echo or prompt_logprobs")
        return self

    @property
    def prompts(self) -> list[str | list[int]]:
        """Each prompt of the request: a text or token ids."""
        if isinstance(self.prompt, str):
            return [self.prompt]
        if self.prompt and isinstance(self.prompt[0], int):
            return [self.prompt]  # one prompt of token ids
        return list(self.prompt)  # type: ignore[arg-type]

    def top_logprobs_asked(self) -> int | None:
        return self.logprobs

    def prompt_logprobs_asked(self) -> int | None:
        """The k best of each prompt position the agents compute: echo's (with logprobs) and
        prompt_logprobs', whichever is more (None: none)."""
        asked = [k for k in (self.logprobs if self.echo else None, self.prompt_logprobs) if k is not None]
        return max(asked, default=None)

    def unsupported(self) -> str | None:
        if self.best_of not in (None, 1, self.n):
            return "best_of is not supported"
        if self.suffix:
            return "suffix is not supported"
        return super().unsupported()


class ContentPart(BaseModel):
    """One part of a message's content; only text parts are served (others are refused by name)."""

    model_config = ConfigDict(extra="allow")

    type: str
    text: str | None = None

    @model_validator(mode="after")
    def _text_part_has_text(self) -> ContentPart:
        if self.type == "text" and self.text is None:
            raise ValueError("a text content part needs a string `text`")
        return self


MAX_TOOLS = 128  # OpenAI's bound


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="allow")

    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict = Field(default_factory=lambda: {"type": "object", "properties": {}})
    strict: bool | None = None  # the arguments of a constrained call always follow the schema


class Tool(BaseModel):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    type: Literal["function"]
    function: FunctionName


class CalledFunction(BaseModel):
    name: str
    arguments: str = "{}"  # JSON text, as OpenAI sends it


class ToolCall(BaseModel):
    model_config = ConfigDict(extra="allow")

    id: str
    type: Literal["function"] = "function"
    function: CalledFunction


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[ContentPart] | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's calls
    tool_call_id: str | None = None  # a tool message answers this call

    def text(self) -> str:
        """The message as plain text; content parts other than text are refused upstream."""
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        return "".join(part.text or "" for part in self.content)


def refused_content(messages: list[ChatMessage]) -> str | None:
    """Why these messages cannot be served (content parts other than text), or None."""
    for message in messages:
        if isinstance(message.content, list) and any(p.type != "text" for p in message.content):
            return "only text content parts are supported"
    return None


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    max_completion_tokens: int | None = Field(None, ge=1)
    tools: list[Tool] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    response_format: ResponseFormat | None = None
    chat_template_kwargs: dict | None = None  # vLLM's: more variables for the chat template
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)  # vLLM's
    # This server's: a reasoning model thinks at most this many tokens (server/thinking_budget.py;
    # at most the answer's length, checked where the length is known: admission.thinking_of)
    max_thinking_tokens: int | None = Field(None, ge=0)

    @field_validator("chat_template_kwargs")
    @classmethod
    def _template_kwargs_bounds(cls, value: dict | None) -> dict | None:
        return check_template_kwargs(value)

    @model_validator(mode="after")
    def _tool_choice_names_a_tool(self) -> Self:
        names = [t.function.name for t in self.tools or []]
        if len(set(names)) != len(names):
            raise ValueError("tools: function names repeat")
        if isinstance(self.tool_choice, NamedToolChoice) and self.tool_choice.function.name not in names:
            raise ValueError(
                f"tool_choice names {self.tool_choice.function.name!r}, which is not among the tools"
            )
        if self.tool_choice in ("required",) and not names:
            raise ValueError("tool_choice required needs tools")
        return self

    @model_validator(mode="after")
    def _one_grammar(self) -> Self:
        if self.structured_outputs and self.response_format and self.response_format.type != "text":
            raise ValueError("response_format and structured_outputs both constrain the answer: send one")
        return self

    def grammar_spec(self) -> GrammarSpec | None:
        return (self.response_format.spec() if self.response_format else None) or super().grammar_spec()

    @model_validator(mode="after")
    def _top_logprobs_need_logprobs(self) -> Self:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        return self

    def top_logprobs_asked(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def prompt_logprobs_asked(self) -> int | None:
        return self.prompt_logprobs

    def unsupported(self) -> str | None:
        return refused_content(self.messages) or super().unsupported()
