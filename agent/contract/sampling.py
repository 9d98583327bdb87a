"""Sampling parameters of one sequence and their limits: part of the prefill message and of both HTTP
APIs' requests. The agent applies them (agent/sampling.py)."""

from __future__ import annotations

import argparse

from pydantic import BaseModel, ConfigDict, Field

# Beyond these an int no longer fits the wire's msgpack or NumPy's types; a larger top_k would
# mean the whole vocabulary anyway.
MAX_TOP_K = 2**31 - 1
MAX_SEED = 2**63 - 1
# Stop strings: every new token of a stream is checked against each, over the held-back text (up to
# the longest one): bounded so that no request can make that cost more than a few hundred
# characters a token. OpenAI allows 4; TGI 4 as well.
MAX_STOP_STRINGS = 4
MAX_STOP_CHARS = 256


def check_stop_strings(stop: list[str]) -> list[str]:
    """The request's stop strings within the bounds (ValueError naming them otherwise)."""
    if len(stop) > MAX_STOP_STRINGS:
        raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings, got {len(stop)}")
    if any(len(s) > MAX_STOP_CHARS for s in stop):
        raise ValueError(f"a stop string may hold at most {MAX_STOP_CHARS} characters")
    return stop


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


# The command lines that sample (the client's, tools.generate) take the same options.
SAMPLING_OPTIONS = ("do_sample", "temperature", "top_k", "top_p", "repetition_penalty", "seed")


def add_sampling_options(parser: argparse.ArgumentParser, top_k: int) -> None:
    """--do-sample, --temperature, --top-k (default `top_k`), --top-p, --repetition-penalty, --seed."""
    parser.add_argument("--do-sample", action="store_true")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=top_k)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--repetition-penalty", type=float, default=1.0)
    parser.add_argument("--seed", type=int)


def sampling_options(args: argparse.Namespace) -> dict:
    """The options add_sampling_options() parsed, named as SamplingParams' fields."""
    return {name: getattr(args, name) for name in SAMPLING_OPTIONS}
