"""KServe v2 over gRPC: the `inference.GRPCInferenceService` Triton serves (server/protos/), so
`tritonclient.grpc` works unchanged. On `server.host`:`server.grpc_port` (off by default), on the
HTTP server's event loop, over the same models (ModelRepository), keys and limits:

    ServerLive, ServerReady, ServerMetadata       liveness, readiness, name and version
    ModelReady, ModelMetadata, ModelConfig         a model's readiness and its tensors (text_input
                                                   and text_output, BYTES [1])
    ModelInfer                                     a BYTES text_input (and one-element inputs or
                                                   request parameters named as the HTTP infer's)
                                                   -> a BYTES text_output, as POST .../infer answers
    ModelStreamInfer                               each request's answer as one response per piece
                                                   (Triton's decoupled mode; an empty last response
                                                   flagged triton_final_response when the request
                                                   asks for it), requests of one stream side by
                                                   side (server/grpc_guards.py bounds them)
    RepositoryIndex, RepositoryModelLoad/Unload    the model repository (admin keys, as over HTTP)

The API key comes as metadata (`authorization: Bearer KEY` or `x-api-key: KEY`) and names the
client for the fair shares; a message is at most `server.max_body_bytes`, calls in flight at most
`server.max_connections`, and server/grpc_guards.py bounds calls per peer, slow messages, idle
streams, a stream's requests and unread replies, and stalled streams. Errors are gRPC status
codes with the HTTP API's messages (GRPC_CODES). The other calls (statistics, shared memory, trace
and log settings) answer UNIMPLEMENTED.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import struct

import grpc

from agent.contract.launcher_control import READY
from config.schema import ServingConfig
from server.access import ApiKeys
from server.collect import collected, whole_answer
from server.errors import ApiError
from server.grpc_guards import CallGuard, answer_stream, peer_address
from server.model_repository import ModelRepository
from server.ops_api import package_version
from server.protos import grpc_service_pb2 as pb
from server.protos import grpc_service_pb2_grpc as pb_grpc
from server.protos import model_config_pb2
from server.tracing import traced
from server.triton_api import VERSION, binary_value, infer_parameters, model_readiness, start_answer

log = logging.getLogger(__name__)
GRPC_CODES = {
    400: grpc.StatusCode.INVALID_ARGUMENT,
    401: grpc.StatusCode.UNAUTHENTICATED,
    403: grpc.StatusCode.PERMISSION_DENIED,
    404: grpc.StatusCode.NOT_FOUND,
    408: grpc.StatusCode.DEADLINE_EXCEEDED,
    413: grpc.StatusCode.INVALID_ARGUMENT,  # a prompt longer than the model takes: retrying will not help
    422: grpc.StatusCode.INVALID_ARGUMENT,
    429: grpc.StatusCode.RESOURCE_EXHAUSTED,
    503: grpc.StatusCode.UNAVAILABLE,
}
FINAL_FLAG, ASK_FINAL = "triton_final_response", "triton_enable_empty_final_response"
CONTENTS = {  # InferTensorContents' field of each datatype (when the client sends no raw contents)
    "BYTES": "bytes_contents",
    "BOOL": "bool_contents",
    "INT32": "int_contents",
    "INT64": "int64_contents",
    "UINT32": "uint_contents",
    "UINT64": "uint64_contents",
    "FP32": "fp32_contents",
    "FP64": "fp64_contents",
}


def grpc_code(status: int) -> grpc.StatusCode:
    return GRPC_CODES.get(status, grpc.StatusCode.INTERNAL)


def request_values(request: pb.ModelInferRequest) -> tuple[dict, dict]:
    """(its request parameters, each input's one value): what infer_parameters reads."""
    parameters = {key: _parameter(value) for key, value in request.parameters.items()}
    raw = list(request.raw_input_contents)
    if raw and len(raw) != len(request.inputs):
        raise ApiError(400, f"{len(raw)} raw_input_contents for {len(request.inputs)} inputs")
    values = {}
    for i, tensor in enumerate(request.inputs):
        if list(tensor.shape) not in ([1], [1, 1]):
            raise ApiError(400, f"input {tensor.name}: one element expected, shape {list(tensor.shape)}")
        if raw:
            values[tensor.name] = binary_value(tensor.name, tensor.datatype, raw[i])
            continue
        field = CONTENTS.get(tensor.datatype)
        elements = list(getattr(tensor.contents, field)) if field else []
        if len(elements) != 1:
            raise ApiError(400, f"input {tensor.name}: one {tensor.datatype} element of contents expected")
        value = elements[0]
        if tensor.datatype == "BYTES":
            try:
                value = value.decode()
            except UnicodeDecodeError:
                raise ApiError(400, f"input {tensor.name}: the text is not UTF-8") from None
        values[tensor.name] = value
    return parameters, values


def _parameter(value: pb.InferParameter):
    kind = value.WhichOneof("parameter_choice")
    return None if kind is None else getattr(value, kind)


def text_response(
    request: pb.ModelInferRequest, text: str | None, final: bool | None = None
) -> pb.ModelInferResponse:
    """A response with `text` as its text_output (None: no output, the empty last response);
    `final`: the triton_final_response flag, for a request that asked for it."""
    response = pb.ModelInferResponse(model_name=request.model_name, model_version=VERSION, id=request.id)
    if text is not None:
        data = text.encode()
        response.outputs.add(name="text_output", datatype="BYTES", shape=[1])
        response.raw_output_contents.append(struct.pack("<I", len(data)) + data)
    if final is not None:
        response.parameters[FINAL_FLAG].bool_param = final
    return response


class InferenceService(pb_grpc.GRPCInferenceServiceServicer):
    def __init__(self, config: ServingConfig, repository: ModelRepository):
        self.repository = repository
        self.limits = config.server
        self.keys = ApiKeys(config.server, config.model_control_mode == "explicit")

    def _traced(self, context: grpc.aio.ServicerContext, call: str):
        """The call's trace (tracing on), a child of the client's `traceparent` metadata."""
        headers = {k: v for k, v in context.invocation_metadata() or () if isinstance(v, str)}
        return traced(self.repository.tracing, "gRPC", call, headers)

    async def _client(self, context: grpc.aio.ServicerContext, path: str) -> str:
        """The client a call comes from, once its key opens `path` (the HTTP path of the same
        call: the same keys open it); the call is aborted otherwise."""
        headers = {
            key.encode(): value.encode()
            for key, value in context.invocation_metadata() or ()
            if isinstance(value, str)
        }
        scope = {"path": path, "client": (peer_address(context), 0), "query_string": b""}
        denied = self.keys.denied(scope, headers)
        if denied is not None:
            await context.abort(grpc_code(denied[0]), denied[1])
        return self.keys.client(scope, headers)

    # ------------------------------------------------------------------------ health, metadata

    async def ServerLive(self, request, context):
        await self._client(context, "/v2/health/live")
        return pb.ServerLiveResponse(live=True)

    async def ServerReady(self, request, context):
        await self._client(context, "/v2/health/ready")
        return pb.ServerReadyResponse(ready=await self.repository.readiness() is None)

    async def ServerMetadata(self, request, context):
        await self._client(context, "/v2")
        return pb.ServerMetadataResponse(
            name="ms-llm-serving", version=package_version(), extensions=["generate"]
        )

    async def ModelReady(self, request, context):
        await self._client(context, f"/v2/models/{request.name}/ready")
        async with failures(context):
            return pb.ModelReadyResponse(ready=await model_readiness(self.repository, request.name) is None)

    async def ModelMetadata(self, request, context):
        await self._client(context, f"/v2/models/{request.name}")
        async with failures(context):
            self.repository.resolve(request.name)
        tensor = pb.ModelMetadataResponse.TensorMetadata
        return pb.ModelMetadataResponse(
            name=request.name,
            versions=[VERSION],
            platform="ms-llm-serving",
            inputs=[tensor(name="text_input", datatype="BYTES", shape=[1])],
            outputs=[tensor(name="text_output", datatype="BYTES", shape=[1])],
        )

    async def ModelConfig(self, request, context):
        await self._client(context, f"/v2/models/{request.name}/config")
        async with failures(context):
            self.repository.resolve(request.name)
        mc = model_config_pb2
        config = mc.ModelConfig(
            name=request.name,
            platform="ms-llm-serving",
            input=[mc.ModelInput(name="text_input", data_type=mc.TYPE_STRING, dims=[1])],
            output=[mc.ModelOutput(name="text_output", data_type=mc.TYPE_STRING, dims=[1])],
            model_transaction_policy=mc.ModelTransactionPolicy(decoupled=True),
        )
        return pb.ModelConfigResponse(config=config)

    # ------------------------------------------------------------------------------- inference

    async def ModelInfer(self, request, context):
        client = await self._client(context, f"/v2/models/{request.model_name}/infer")
        with self._traced(context, "ModelInfer"):
            async with failures(context):
                parameters, values = request_values(request)
                prompt, p = infer_parameters(parameters, values)
                stream = await start_answer(self.repository, client, request.model_name, prompt, p)
                text, _ = await whole_answer(stream)  # a cancelled call closes the stream: aborted
            return text_response(request, text if p.exclude_input_in_output else prompt + text)

    async def ModelStreamInfer(self, request_iterator, context) -> None:
        client = await self._client(context, "/v2/models/stream/infer")

        async def answer(request: pb.ModelInferRequest, replies: asyncio.Queue) -> None:
            with self._traced(context, "ModelStreamInfer"):
                await self._answer_on_stream(request, client, replies)

        await answer_stream(context, self.limits, answer)  # it reads the messages itself

    async def _answer_on_stream(
        self, request: pb.ModelInferRequest, client: str, responses: asyncio.Queue
    ) -> None:
        """One request of a stream: its pieces as responses, or its error; with
        triton_enable_empty_final_response, a last empty response flagged final."""
        asked_final = request.parameters[ASK_FINAL].bool_param if ASK_FINAL in request.parameters else False
        flag = False if asked_final else None
        try:
            parameters, values = request_values(request)
            prompt, p = infer_parameters(parameters, values)
            # The key opens every model alike: the per-request model needs no second check.
            stream = await start_answer(self.repository, client, request.model_name, prompt, p)
            async with contextlib.aclosing(stream):
                if not p.exclude_input_in_output:
                    await responses.put(
                        pb.ModelStreamInferResponse(infer_response=text_response(request, prompt, flag))
                    )
                async for _, out in collected([stream]):
                    if out.text:
                        piece = text_response(request, out.text, flag)
                        await responses.put(pb.ModelStreamInferResponse(infer_response=piece))
        except ApiError as exc:
            error = pb.ModelStreamInferResponse(
                error_message=exc.message, infer_response=text_response(request, None)
            )
            await responses.put(error)
            return
        if asked_final:
            await responses.put(
                pb.ModelStreamInferResponse(infer_response=text_response(request, None, True))
            )

    # ------------------------------------------------------------------------------ repository

    async def RepositoryIndex(self, request, context):
        await self._client(context, "/v2/repository/index")
        index = pb.RepositoryIndexResponse.ModelIndex
        return pb.RepositoryIndexResponse(
            models=[
                index(name=m.name, version=VERSION, state=m.state, reason=m.reason)
                for m in self.repository.models.values()
                if m.state == READY or not request.ready
            ]
        )

    async def RepositoryModelLoad(self, request, context):
        await self._client(context, f"/v2/repository/models/{request.model_name}/load")
        async with failures(context):
            await self.repository.load(request.model_name)
        return pb.RepositoryModelLoadResponse()

    async def RepositoryModelUnload(self, request, context):
        await self._client(context, f"/v2/repository/models/{request.model_name}/unload")
        async with failures(context):
            await self.repository.unload(request.model_name)
        return pb.RepositoryModelUnloadResponse()


@contextlib.asynccontextmanager
async def failures(context: grpc.aio.ServicerContext):
    """An ApiError inside ends the call with its status's gRPC code and its message."""
    try:
        yield
    except ApiError as exc:
        await context.abort(grpc_code(exc.status), exc.message)


async def start_grpc(config: ServingConfig, repository: ModelRepository) -> grpc.aio.Server:
    """The gRPC server listening on server.host:server.grpc_port (OSError if it cannot)."""
    s = config.server
    server = grpc.aio.server(
        options=[
            ("grpc.max_receive_message_length", s.max_body_bytes),
            ("grpc.so_reuseport", 0),
            # A connection with no call: closed (GOAWAY; a client reconnects when it calls again).
            ("grpc.max_connection_idle_ms", int(s.grpc_idle_timeout_s * 1000)),
        ],
        interceptors=[CallGuard(s)],
        maximum_concurrent_rpcs=s.max_connections,
    )
    pb_grpc.add_GRPCInferenceServiceServicer_to_server(InferenceService(config, repository), server)
    address = f"[{s.host}]:{s.grpc_port}" if ":" in s.host else f"{s.host}:{s.grpc_port}"
    try:
        server.add_insecure_port(address)
    except RuntimeError as exc:
        raise OSError(f"gRPC cannot listen on {address}: {exc}") from exc
    await server.start()
    log.info("KServe v2 gRPC on %s", address)
    return server
