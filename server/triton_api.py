"""Triton's HTTP API for text models, so that Triton clients work unchanged:

    GET  /v2, /v2/health/live, /v2/health/ready        server metadata, liveness, readiness
    GET  /v2/models/{name}[/versions/1], .../ready     model metadata (inputs, outputs), readiness
                                                        (the repository API: server/repository_api.py)
    POST /v2/models/{name}/generate                     {"text_input", "parameters"} -> {"model_name",
                                                        "model_version", "text_output"}
    POST /v2/models/{name}/generate_stream              the same as SSE events, one per piece
    POST /v2/models/{name}/infer                        KServe v2: a BYTES `text_input` tensor (JSON
                                                        or Triton's binary tensor extension) -> a
                                                        BYTES `text_output` tensor (JSON)

The parameters are vLLM's as Triton's vLLM backend takes them (max_tokens 16, temperature 1,
top_p, top_k, seed, stop, ...); the answer is the generated text (`exclude_input_in_output`
false puts the prompt before it). Errors are `{"error": message}`.
"""

from __future__ import annotations

import contextlib
import json
import struct

import numpy as np
from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from sse_starlette.sse import EventSourceResponse

from agent.contract.launcher_control import READY
from agent.contract.sampling import (
    MAX_PENALTY,
    MAX_REPETITION_PENALTY,
    MAX_SEED,
    MAX_TEMPERATURE,
    MAX_TOP_K,
    MIN_REPETITION_PENALTY,
    check_stop_strings,
)
from server.access import client_of
from server.admission import Admission, Prompt, admit_answers
from server.client_disconnect import unless_disconnected
from server.collect import whole_answer
from server.errors import TRITON, ApiError, declares
from server.model_repository import ModelRepository
from server.ops_api import package_version
from server.output import AnswerStream
from server.request_body import json_body

VERSION = "1"  # one version of each model
BINARY_HEADER = "inference-header-content-length"
NUMPY_TYPES = {"BOOL": "?", "INT32": "<i4", "INT64": "<i8", "FP32": "<f4", "FP64": "<f8"}
# Request parameters of Triton's own protocol (tritonclient sends some): not generation parameters.
PROTOCOL_PARAMETERS = {
    "binary_data_output",
    "triton_enable_empty_final_response",
    "priority",
    "timeout",
    "sequence_id",
    "sequence_start",
    "sequence_end",
}


class TritonParameters(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    max_tokens: int = Field(16, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=MAX_TEMPERATURE)  # 0: greedy
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=-1, le=MAX_TOP_K)  # vLLM's -1 (and 0): no top-k
    seed: int | None = Field(None, ge=0, le=MAX_SEED)
    stop: list[str] = Field(default_factory=list)
    ignore_eos: bool = False
    repetition_penalty: float = Field(1.0, ge=MIN_REPETITION_PENALTY, le=MAX_REPETITION_PENALTY)
    presence_penalty: float = Field(0.0, ge=0.0, le=MAX_PENALTY)
    frequency_penalty: float = Field(0.0, ge=0.0, le=MAX_PENALTY)
    exclude_input_in_output: bool = True
    chat_template: bool | None = None  # as the native API's: default server.apply_chat_template
    stream: bool = False  # what /generate_stream means; accepted for clients that send it

    @field_validator("stop", mode="before")
    @classmethod
    def _stop(cls, value):
        return [value] if isinstance(value, str) else value or []

    @field_validator("stop")
    @classmethod
    def _stop_bounds(cls, value: list[str]) -> list[str]:
        return check_stop_strings(value)

    @field_validator("top_k")
    @classmethod
    def _no_top_k(cls, value: int) -> int:
        return max(0, value)


class GenerateRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    text_input: str
    parameters: TritonParameters = Field(default_factory=TritonParameters)


class InferTensor(BaseModel):
    model_config = ConfigDict(extra="allow")

    name: str
    shape: list[int]
    datatype: str
    data: list | None = None
    parameters: dict = Field(default_factory=dict)


class InferRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    id: str | None = None
    inputs: list[InferTensor] = Field(min_length=1, max_length=16)
    outputs: list[dict] | None = None
    parameters: dict = Field(default_factory=dict)


def model_metadata(name: str) -> dict:
    return {
        "name": name,
        "versions": [VERSION],
        "platform": "ms-llm-serving",
        "inputs": [{"name": "text_input", "datatype": "BYTES", "shape": [1]}],
        "outputs": [{"name": "text_output", "datatype": "BYTES", "shape": [1]}],
    }


async def model_readiness(repository: ModelRepository, name: str) -> str | None:
    """Why the model cannot answer now (None: it can)."""
    model = repository.resolve(name)
    loaded = model.loaded if model.state == READY else None
    return model.status() if loaded is None else await loaded.engine.readiness()


async def start_answer(
    repository: ModelRepository, client: str, name: str, prompt_text: str, p: TritonParameters
) -> AnswerStream:
    """The request admitted on the named model: its answer's stream."""
    model = repository.serving(name)
    chat = model.config.server.apply_chat_template if p.chat_template is None else p.chat_template
    messages = [{"role": "user", "content": prompt_text}] if chat else None
    admission = Admission(
        prompt=Prompt(prompt_text, messages, param="text_input"),
        sampling=p,
        do_sample=p.temperature > 0,
        seeds=(p.seed,),
        max_tokens=p.max_tokens,
        max_tokens_param="max_tokens",
        stop=tuple(p.stop),
        ignore_eos=p.ignore_eos,
        client=client,
    )
    [stream] = (await admit_answers(model, TRITON, admission)).streams
    return stream


async def answer_text(
    http: Request, repository: ModelRepository, name: str, prompt_text: str, p: TritonParameters
) -> str | Response:
    """The whole answer's text, or a Response when the client left first (its generation
    stopped, its slot freed)."""
    stream = await start_answer(repository, client_of(http.scope), name, prompt_text, p)
    done = await unless_disconnected(http, [stream], whole_answer(stream))
    if isinstance(done, Response):
        return done
    text, _ = done
    return text if p.exclude_input_in_output else prompt_text + text


async def text_pieces(name: str, prompt_text: str, p: TritonParameters, stream: AnswerStream):
    """The answer as generate_stream's events: the prompt first unless excluded, then each piece of
    text; an error is the last event."""
    async with contextlib.aclosing(stream):
        if not p.exclude_input_in_output:
            yield json.dumps({"model_name": name, "model_version": VERSION, "text_output": prompt_text})
        async for out in stream:
            if out.text:
                piece = {"model_name": name, "model_version": VERSION, "text_output": out.text}
                yield json.dumps(piece, ensure_ascii=False)
            if out.error:
                yield json.dumps({"error": out.error})
                return


def infer_parameters(parameters: dict, tensors: dict) -> tuple[str, TritonParameters]:
    """An infer request's prompt (its BYTES text_input) and parameters (its request `parameters` and
    its other one-element inputs, named as the parameters); 400 naming what is wrong. (HTTP and
    gRPC alike: server/grpc_server.py.)"""
    prompt = tensors.pop("text_input", None)
    if not isinstance(prompt, str):
        raise ApiError(400, "infer needs a BYTES input named text_input (the prompt: one string)")
    try:
        asked = {k: v for k, v in parameters.items() if k not in PROTOCOL_PARAMETERS}
        return prompt, TritonParameters.model_validate({**asked, **tensors})
    except ValidationError as exc:
        problem = exc.errors()[0]
        where = ".".join(str(part) for part in problem["loc"])
        raise ApiError(400, f"bad parameter or input {where}: {problem['msg']}") from None


def infer_reply(name: str, req: InferRequest, text: str) -> dict:
    reply: dict = {
        "model_name": name,
        "model_version": VERSION,
        "outputs": [{"name": "text_output", "datatype": "BYTES", "shape": [1], "data": [text]}],
    }
    if req.id is not None:
        reply["id"] = req.id
    return reply


def triton_router(repository: ModelRepository) -> APIRouter:
    router = APIRouter(prefix="/v2", dependencies=[declares(TRITON)])
    generate_request = json_body(GenerateRequest)

    @router.get("")
    async def server_metadata():
        return {"name": "ms-llm-serving", "version": package_version(), "extensions": ["generate"]}

    @router.get("/health/live")
    async def live():
        return {}

    @router.get("/health/ready")
    async def server_ready():
        reason = await repository.readiness()
        if reason:
            raise ApiError(503, f"not ready: {reason}")
        return {}

    @router.get("/models/{name}")
    @router.get("/models/{name}/versions/" + VERSION)
    async def metadata(name: str):
        repository.resolve(name)
        return model_metadata(name)

    @router.get("/models/{name}/ready")
    async def model_ready(name: str):
        reason = await model_readiness(repository, name)
        if reason:
            raise ApiError(503, f"model {name!r} is not ready: {reason}")
        return {}

    @router.post("/models/{name}/generate")
    async def generate(http: Request, name: str, req: GenerateRequest = Depends(generate_request)):
        text = await answer_text(http, repository, name, req.text_input, req.parameters)
        if isinstance(text, Response):
            return text
        return {"model_name": name, "model_version": VERSION, "text_output": text}

    @router.post("/models/{name}/generate_stream")
    async def generate_stream(http: Request, name: str, req: GenerateRequest = Depends(generate_request)):
        stream = await start_answer(repository, client_of(http.scope), name, req.text_input, req.parameters)
        return EventSourceResponse(text_pieces(name, req.text_input, req.parameters, stream))

    @router.post("/models/{name}/infer")
    async def infer(name: str, http: Request):
        repository.serving(name)
        req, tensors = parse_infer(await http.body(), http.headers.get(BINARY_HEADER))
        prompt, p = infer_parameters(req.parameters, tensors)
        text = await answer_text(http, repository, name, prompt, p)
        return text if isinstance(text, Response) else infer_reply(name, req, text)

    return router


def parse_infer(body: bytes, header_length: str | None) -> tuple[InferRequest, dict]:
    """A KServe v2 request (JSON, or JSON followed by binary tensors when `header_length` says
    where the JSON ends) -> the request and each input's single value (str for BYTES)."""
    binary = b""
    if header_length is not None:
        try:
            split = int(header_length)
        except ValueError:
            raise ApiError(400, f"{BINARY_HEADER} must be an integer") from None
        if not 0 < split <= len(body):
            raise ApiError(400, f"{BINARY_HEADER} {split} is outside the body of {len(body)} bytes")
        body, binary = body[:split], body[split:]
    try:
        req = InferRequest.model_validate_json(body)
    except ValidationError as exc:
        raise ApiError(400, f"not a KServe v2 inference request: {exc.errors()[0]['msg']}") from None
    values: dict = {}
    offset = 0
    for tensor in req.inputs:
        if tensor.shape not in ([1], [1, 1]):
            raise ApiError(400, f"input {tensor.name}: one element expected, shape {tensor.shape}")
        size = tensor.parameters.get("binary_data_size")
        if size is None:
            if not tensor.data or len(tensor.data) != 1:
                raise ApiError(400, f"input {tensor.name}: one element of data expected")
            value = tensor.data[0]
            value = value[0] if isinstance(value, list) and len(value) == 1 else value
        else:
            if not isinstance(size, int) or size < 0 or offset + size > len(binary):
                raise ApiError(400, f"input {tensor.name}: binary_data_size {size} past the body")
            value = binary_value(tensor.name, tensor.datatype, binary[offset : offset + size])
            offset += size
        values[tensor.name] = value
    return req, values


def binary_value(name: str, datatype: str, raw: bytes):
    """One element of Triton's binary tensor format (HTTP's binary extension, gRPC's raw contents):
    BYTES as a 4-byte little-endian length and the bytes; numbers as their little-endian values."""
    if datatype == "BYTES":
        if len(raw) < 4 or struct.unpack("<I", raw[:4])[0] != len(raw) - 4:
            raise ApiError(400, f"input {name}: a BYTES element is a 4-byte length and that many bytes")
        try:
            return raw[4:].decode()
        except UnicodeDecodeError:
            raise ApiError(400, f"input {name}: the text is not UTF-8") from None
    dtype = NUMPY_TYPES.get(datatype)
    if dtype is None or len(raw) != np.dtype(dtype).itemsize:
        raise ApiError(400, f"input {name}: datatype {datatype} of {len(raw)} bytes is not served")
    return np.frombuffer(raw, dtype).item()
