"""Sampling parameters of one sequence and their limits: part of the prefill message and of both HTTP
APIs' requests. The agent applies them (agent/sampling.py)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

# Beyond these an int no longer fits the wire's msgpack or NumPy's types; a larger top_k would
# mean the whole vocabulary anyway.
MAX_TOP_K = 2**31 - 1
MAX_SEED = 2**63 - 1


class SamplingParams(BaseModel):
    model_config = ConfigDict(frozen=True, allow_inf_nan=False)

    do_sample: bool = False
    temperature: float = Field(1.0, ge=0.0)
    top_k: int = Field(0, ge=0, le=MAX_TOP_K)  # 0: no top-k limit
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    repetition_penalty: float = Field(1.0, gt=0.0)
    presence_penalty: float = Field(0.0, ge=0.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=0.0, le=2.0)
    seed: int | None = Field(None, ge=0, le=MAX_SEED)

    @property
    def greedy(self) -> bool:
        return not self.do_sample or self.temperature == 0.0 or self.top_k == 1
