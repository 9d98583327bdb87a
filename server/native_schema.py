"""Request bodies of the native API, named as the MindSpore llm-serving names them."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from agent.contract.sampling import (
    MAX_LOGPROBS,
    MAX_PRIORITY,
    MAX_REPETITION_PENALTY,
    MAX_SEED,
    MAX_TEMPERATURE,
    MAX_TOP_K,
    MIN_REPETITION_PENALTY,
    CacheSalt,
    check_stop_strings,
    unserved_sampling,
)


class TgiGrammar(BaseModel):
    """TGI's `grammar`: a JSON Schema (an object, or its JSON text) or a regex the answer follows."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["json", "regex"]
    value: dict | str


class Parameters(BaseModel):
    """Generation parameters with upstream's defaults; top_k is clamped to [0, 2^31 - 1] and top_p
    to [0.01, 1]; NaN and infinity are refused, and so is any other key (a sampling parameter no
    sampler here implements with a message saying so)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    do_sample: bool = False
    top_k: int = 3
    top_p: float = 1.0
    # vLLM's and llama.cpp's (0: off); TGI's typical_p (1 or null: off)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    typical_p: float = Field(1.0, gt=0.0, le=1.0)
    temperature: float = Field(1.0, ge=0.0, le=MAX_TEMPERATURE)
    repetition_penalty: float = Field(1.0, ge=MIN_REPETITION_PENALTY, le=MAX_REPETITION_PENALTY)
    max_new_tokens: int = Field(300, ge=1)
    return_full_text: bool = False
    return_protocol: Literal["sse", "plain"] = "sse"
    seed: int | None = Field(None, ge=0, le=MAX_SEED)
    stop: list[str] = Field(default_factory=list)
    truncate: int | None = Field(None, ge=1, description="keep only the last N prompt tokens")
    ignore_eos: bool = Field(
        False,
        description="keep generating past EOS up to max_new_tokens "
        "(benchmarks; vLLM and llama.cpp name it so)",
    )
    chat_template: bool | None = Field(
        None, description="apply the model's chat template; default from server.apply_chat_template"
    )
    # TGI's: details (finish reason, tokens and their logprobs) in the reply; top_n_tokens: the
    # best alternatives of each token too.
    details: bool = False
    top_n_tokens: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    decoder_input_details: bool = Field(
        False,
        description="TGI's: details.prefill, the prompt's tokens with their logprobs (whole replies only)",
    )
    grammar: TgiGrammar | None = None
    priority: int = Field(
        0, ge=-MAX_PRIORITY, le=MAX_PRIORITY, description="lower first (scheduler.scheduling_policy priority)"
    )
    speculate: bool = Field(True, description="false: no tokens proposed for it (runtime.speculation)")
    cache_salt: CacheSalt | None = Field(
        None, description="prefix-cache blocks shared only with requests of the same salt (vLLM's cache_salt)"
    )
    # TGI's: accepted off for its clients, refused on (no watermark is applied here)
    watermark: bool = False

    def logprobs_asked(self) -> int | None:
        """The agents compute logprobs only for requests that show them (details, top_n_tokens)."""
        return (self.top_n_tokens or 0) if self.details or self.top_n_tokens else None

    def prompt_logprobs_asked(self) -> int | None:
        """decoder_input_details: each prompt token's logprob (no alternatives), shown in the
        details (none without them)."""
        return 0 if self.decoder_input_details and self.details else None

    @model_validator(mode="before")
    @classmethod
    def _no_unserved_sampler(cls, data):
        problem = unserved_sampling(data, cls.model_fields) if isinstance(data, dict) else None
        if problem:
            raise ValueError(problem)
        return data

    @field_validator("typical_p", mode="before")
    @classmethod
    def _null_typical_p(cls, value):
        return 1.0 if value is None else value

    @field_validator("watermark")
    @classmethod
    def _no_watermark(cls, value: bool) -> bool:
        if value:
            raise ValueError("watermark is not supported")
        return value

    @field_validator("top_k")
    @classmethod
    def _top_k(cls, value: int) -> int:
        return min(MAX_TOP_K, max(0, value))

    @field_validator("top_p")
    @classmethod
    def _top_p(cls, value: float) -> float:
        return min(1.0, max(0.01, value))

    @field_validator("stop", mode="before")
    @classmethod
    def _stop(cls, value):
        return [value] if isinstance(value, str) else value

    @field_validator("stop")
    @classmethod
    def _stop_bounds(cls, value: list[str]) -> list[str]:
        return check_stop_strings(value)


class ClientRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    inputs: str
    stream: bool = False
    parameters: Parameters = Field(default_factory=Parameters)

    @field_validator("parameters", mode="before")
    @classmethod
    def _null_parameters(cls, value):
        return {} if value is None else value
