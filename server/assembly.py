"""Request assembly, shared by the native and the OpenAI APIs: the served-model check, the sampling
parameters of a request, and its admission into the engine (a refusal becomes an ApiError)."""

from __future__ import annotations

import uuid

from pydantic import BaseModel

from agent.contract.sampling import SamplingParams
from config.schema import ServingConfig
from scheduler.batch_scheduler import AdmissionError
from server.errors import ApiError, refusal_status
from server.output import AnswerStream, OutputProcessor

# The fields both APIs' requests name as SamplingParams does; do_sample and the seed are per API.
SAMPLING_FIELDS = set(SamplingParams.model_fields) - {"do_sample", "seed"}


def served_models(config: ServingConfig) -> list[str]:
    return [config.model.name, *config.model.aliases]


def check_served(model: str, served: list[str]) -> None:
    if model not in served:
        raise ApiError(
            404,
            f"model {model!r} is not served here; served: {', '.join(served)}",
            param="model",
            code="model_not_found",
        )


def sampling_params(request: BaseModel, do_sample: bool, seed: int | None) -> SamplingParams:
    """The request's sampling fields (those it has; the rest keep SamplingParams' defaults)."""
    return SamplingParams(do_sample=do_sample, seed=seed, **request.model_dump(include=SAMPLING_FIELDS))


def check_answer_fits(prompt_len: int, max_new_tokens: int, context: int, openai: bool, param: str) -> None:
    """An explicit answer length that can never fit is refused, naming the limit (TGI answers 422,
    vLLM 400), instead of a silently shortened answer."""
    if prompt_len + max_new_tokens > context:
        raise ApiError(
            400 if openai else 422,
            f"the prompt ({prompt_len} tokens) + {param} ({max_new_tokens}) exceeds the "
            f"context of {context} tokens: ask for at most {max(0, context - prompt_len)}",
            param=param,
        )


async def admit(
    outputs: OutputProcessor,
    prompt: list[int],
    samplings: list[SamplingParams],
    max_new_tokens: int,
    stop: list[str],
    ignore_eos: bool,
    openai: bool,
) -> list[AnswerStream]:
    """One answer stream per sampling (OpenAI's `n` choices), all admitted or none."""
    streams = []
    try:
        for sampling in samplings:
            streams.append(
                outputs.generate_answer(
                    uuid.uuid4().hex, prompt, sampling, max_new_tokens, tuple(stop), ignore_eos
                )
            )
    except AdmissionError as exc:
        for stream in streams:  # admitted choices of a refused request go too
            await stream.aclose()
        raise ApiError(refusal_status(exc.reason, openai), str(exc)) from exc
    return streams
