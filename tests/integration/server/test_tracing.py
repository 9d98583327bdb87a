"""OpenTelemetry tracing (server.otlp_endpoint) against a real agent and `start_server.py` on the tiny
model, exporting to an OTLP receiver in this process: one request with a W3C traceparent gives
the span tree the README describes (the request's span under the client's, queue, prefill with
its chunks, decode with its agent steps) with the client's trace id and the GenAI attributes; a
request the access check refuses makes no span."""

import threading
from concurrent import futures

import grpc
import httpx
import numpy as np
import pytest
import tritonclient.grpc as triton_grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from agent_harness import LONG_ANSWERS_RUNTIME, free_ports, serving_stack, write_config
from waiting import wait_until

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
KEY = "tracing-key"
AUTH = {"authorization": f"Bearer {KEY}"}  # lower case: gRPC metadata too
PARENT_ID = "00f067aa0ba902b7"


class Receiver(trace_service_pb2_grpc.TraceServiceServicer):
    """An OTLP/gRPC trace collector that keeps every span it is sent."""

    def __init__(self):
        self.spans, self.lock = [], threading.Lock()

    def Export(self, request, context):
        with self.lock:
            for resource in request.resource_spans:
                for scope in resource.scope_spans:
                    self.spans.extend(scope.spans)
        return trace_service_pb2.ExportTraceServiceResponse()

    def of_trace(self, trace_id: str) -> list:
        with self.lock:
            return [s for s in self.spans if s.trace_id.hex() == trace_id]


@pytest.fixture(scope="module")
def traced(tmp_path_factory, tiny_llama_dir):
    agent_port, http_port, otlp_port, grpc_port = free_ports(4)
    receiver = Receiver()
    collector = grpc.server(futures.ThreadPoolExecutor(2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(receiver, collector)
    collector.add_insecure_port(f"127.0.0.1:{otlp_port}")
    collector.start()
    path = write_config(
        tmp_path_factory.mktemp("tracing"),
        tiny_llama_dir,
        [agent_port],
        runtime=LONG_ANSWERS_RUNTIME,
        agents={"restart_policy": "exit"},
        server={
            "port": http_port,
            "grpc_port": grpc_port,
            "otlp_endpoint": f"http://127.0.0.1:{otlp_port}",
            "api_keys": [KEY],
        },
    )
    try:
        with serving_stack(path):
            yield f"http://127.0.0.1:{http_port}", receiver, f"127.0.0.1:{grpc_port}"
    finally:
        collector.stop(0)


def attributes(span) -> dict:
    values = {}
    for kv in span.attributes:
        kind = kv.value.WhichOneof("value")
        value = getattr(kv.value, kind)
        values[kv.key] = (
            [getattr(v, v.WhichOneof("value")) for v in value.values] if kind == "array_value" else value
        )
    return values


def test_one_request_gives_the_span_tree_under_the_clients_trace(traced):
    base, receiver, _ = traced
    prompt = "Tell me about the weather in Paris, in London and in Rome, in detail. " * 2  # chunks of 64
    reply = httpx.post(
        f"{base}/v1/chat/completions",
        headers={**AUTH, "traceparent": f"00-{TRACE_ID}-{PARENT_ID}-01"},
        json={
            "model": "tiny",
            "messages": [{"role": "user", "content": prompt}],
            "max_tokens": 6,
            "temperature": 0,
        },
        timeout=60,
    )
    assert reply.status_code == 200, reply.text
    usage = reply.json()["usage"]
    # the request's own span ends last (after the reply) and may come in a later export batch than
    # its children: wait for it, then every span has come
    wait_until(
        lambda: any(s.parent_span_id.hex() == PARENT_ID for s in receiver.of_trace(TRACE_ID)),
        15,
        "the request's own span",
    )
    spans = receiver.of_trace(TRACE_ID)
    [root] = [s for s in spans if s.parent_span_id.hex() == PARENT_ID]
    assert root.name == "chat tiny" and root.kind == root.SPAN_KIND_SERVER
    found = attributes(root)
    assert found["gen_ai.operation.name"] == "chat" and found["gen_ai.request.model"] == "tiny"
    assert found["gen_ai.usage.input_tokens"] == usage["prompt_tokens"]
    assert found["gen_ai.usage.output_tokens"] == usage["completion_tokens"]
    assert found["gen_ai.request.temperature"] == 0.0 and found["http.response.status_code"] == 200
    assert (
        0
        < found["gen_ai.server.time_to_first_token"]
        < (root.end_time_unix_nano - root.start_time_unix_nano) / 1e9
    )

    def children(parent) -> list:
        return sorted(
            (s for s in spans if s.parent_span_id == parent.span_id), key=lambda s: s.start_time_unix_nano
        )

    assert [s.name for s in children(root)] == ["queue", "prefill", "decode"]
    queue, prefill, decode = children(root)
    chunks = children(prefill)
    assert len(chunks) > 1 and {s.name for s in chunks} == {"prefill chunk"}
    positions = [
        (attributes(c)["llm_serving.positions.start"], attributes(c)["llm_serving.positions.end"])
        for c in chunks
    ]
    assert positions[0][0] == 0 and positions[-1][1] == usage["prompt_tokens"]
    assert all(a[1] == b[0] for a, b in zip(positions, positions[1:]))  # contiguous chunks
    steps = children(decode)
    assert {s.name for s in steps} == {"agent step"}
    assert len(steps) == usage["completion_tokens"] - 1  # the first token came with the last chunk
    assert queue.end_time_unix_nano <= prefill.start_time_unix_nano <= prefill.end_time_unix_nano
    assert (
        prefill.end_time_unix_nano
        <= decode.start_time_unix_nano
        <= decode.end_time_unix_nano
        <= root.end_time_unix_nano
    )
    assert all(s.trace_id.hex() == TRACE_ID for s in spans)


def test_a_request_without_traceparent_starts_its_own_trace(traced):
    base, receiver, _ = traced
    before = {s.trace_id for s in receiver.spans}
    reply = httpx.post(
        f"{base}/models/tiny/generate",
        json={"inputs": "Hello", "parameters": {"max_new_tokens": 3}},
        headers=AUTH,
    )
    assert reply.status_code == 200
    [root] = wait_until(
        lambda: [s for s in receiver.spans if s.trace_id not in before and s.name == "generate tiny"],
        15,
        "a 'generate tiny' span of a new trace",
    )
    assert not root.parent_span_id and attributes(root)["gen_ai.usage.output_tokens"] == 3


def spans_of(receiver: Receiver, trace_id: str, name: str) -> list:
    """The trace's spans, once its span `name` has come (the request's own span comes last)."""
    wait_until(lambda: any(s.name == name for s in receiver.of_trace(trace_id)), 15, f"a {name!r} span")
    return receiver.of_trace(trace_id)


def test_a_grpc_infer_is_traced_under_the_clients_traceparent(traced):
    _, receiver, grpc_address = traced
    trace_id, parent = "0af7651916cd43dd8448eb211c80319c", "b7ad6b7169203331"
    text = triton_grpc.InferInput("text_input", [1], "BYTES")
    text.set_data_from_numpy(np.array([b"Hello"], dtype=object))
    with triton_grpc.InferenceServerClient(grpc_address) as client:
        client.infer(
            "tiny",
            [text],
            parameters={"max_tokens": 3},
            headers={**AUTH, "traceparent": f"00-{trace_id}-{parent}-01"},
        )
    spans = spans_of(receiver, trace_id, "generate tiny")
    [root] = [s for s in spans if s.parent_span_id.hex() == parent]
    assert root.name == "generate tiny" and attributes(root)["gen_ai.usage.output_tokens"] == 3
    assert {s.name for s in spans if s.parent_span_id == root.span_id} == {"queue", "prefill", "decode"}


def test_a_request_without_a_valid_key_makes_no_span(traced):
    """Refused before tracing: an unauthenticated client cannot create spans, nor name them (on
    main the span was `POST <the path it sent>`). Spans leave in order, so once a later
    authenticated request's span has arrived, the refused one's would have too."""
    base, receiver, _ = traced
    refused_trace, later_trace = "11111111111111111111111111111111", "22222222222222222222222222222222"
    refused = httpx.post(
        f"{base}/made-up-span-name",
        json={},
        headers={"Authorization": "Bearer wrong", "traceparent": f"00-{refused_trace}-{PARENT_ID}-01"},
    )
    assert refused.status_code == 401
    later = httpx.post(
        f"{base}/models/tiny/generate",
        json={"inputs": "Hello", "parameters": {"max_new_tokens": 2}},
        headers={**AUTH, "traceparent": f"00-{later_trace}-{PARENT_ID}-01"},
    )
    assert later.status_code == 200
    assert any(s.name == "generate tiny" for s in spans_of(receiver, later_trace, "generate tiny"))
    assert receiver.of_trace(refused_trace) == []
    assert not any("made-up-span-name" in s.name for s in receiver.spans)
