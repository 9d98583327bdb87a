"""The scheduler's policy: how many requests may wait, what one step computes, and how clients
share the server (scheduler/batch_scheduler.py, client_share.py, step_costs.py, block_manager.py)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, ValidationInfo, field_validator

from config.base import Section


class SchedulerSection(Section):
    """What the engine hands the BatchScheduler: admission bounds, the step budget, prefix caching
    and the fairness between clients (their shares are of the admission bounds beside them)."""

    max_waiting_requests: int = Field(64, ge=1, description="queue bound; beyond it: 503")
    max_tokens_in_flight: int | None = Field(
        131072,
        ge=1,
        description="bound on prompt + max_new_tokens over all admitted requests; "
        "beyond it: 503 (429 on the OpenAI API); null: no bound",
    )
    max_prefills_per_step: int = Field(
        16, ge=1, description="prompts placed per iteration (their chunks then share the step budget)"
    )
    max_num_batched_tokens: int = Field(
        512,
        ge=2,
        description="positions one group's step computes: its decode rows first, then prompt "
        "chunks (beside decode rows also bounded by decode_stall_ratio): a prompt alone takes "
        "fewer, longer steps",
    )
    decode_stall_ratio: float = Field(
        1.5,
        ge=0,
        description="while sequences decode, a step that also computes prompt chunks takes at most "
        "this many times a decode step alone (learned from the agents' compute times): a stream's "
        "slowest token stays this multiple of its usual one; the extra time grows in proportion "
        "while prompts wait (each weighs as a stream); 0: the token budget alone decides",
    )
    pooling_stall_ratio: float = Field(
        1.2,
        ge=0,
        description="while sequences decode, a step that also computes pooling requests' inputs "
        "(embeddings, scores) takes at most this many times a decode step alone (from the costs "
        "learned of the agents' compute times): the streams keep about 1 / ratio of their speed beside an "
        "embedding job, which advances by at least a position a step; 0: as any prompt",
    )
    enable_prefix_caching: bool = Field(
        True, description="reuse the KV of full blocks of earlier prompts with the same prefix"
    )
    client_share: float = Field(
        0.5,
        gt=0,
        le=1,
        description="fairness between clients (API keys, or addresses when keys are off): once the "
        "waiting queue or the tokens in flight reach their bound, a client holding less than this "
        "share of it is still admitted (up to 1 + share times the bound), one holding more gets "
        "429; 1: no per-client share. Free slots go first to the clients running the fewest",
    )
    max_running_per_client: int | None = Field(
        None, ge=1, description="sequences one client runs at once (its others wait); none: every slot"
    )
    scheduling_policy: Literal["fcfs", "priority"] = Field(
        "fcfs",
        description="priority: requests' `priority` (lower first) orders them within their "
        "client's share; fcfs: arrival order, and a request with a priority is refused",
    )

    @field_validator("decode_stall_ratio", "pooling_stall_ratio")
    @classmethod
    def _stall_above_one(cls, ratio: float, info: ValidationInfo) -> float:
        if 0 < ratio <= 1:
            raise ValueError(
                f"{info.field_name} ({ratio}) must exceed 1 (a step with prompt chunks takes longer "
                "than a decode step alone), or be 0 to let the token budget alone decide"
            )
        return ratio


# Every key here was the server section's until issue 56 (ServerSection refuses them, naming this place).
MOVED_FROM_SERVER = tuple(SchedulerSection.model_fields)
