"""KServe v2 gRPC (server.grpc_port) through Triton's own `tritonclient.grpc` against a real agent
and `start_server.py` on the tiny model with an API key on: infer and stream_infer answer with the
HTTP infer's greedy answers, health, metadata and the repository answer, and bad requests get
gRPC status codes with the HTTP API's messages."""

import queue

import numpy as np
import pytest
import tritonclient.grpc as triton_grpc
import tritonclient.http as triton_http
from tritonclient.utils import InferenceServerException

from agent_harness import LONG_ANSWERS_RUNTIME, free_ports, serving_stack, write_config

KEY = "grpc-key"
AUTH = {"authorization": f"Bearer {KEY}"}
MAX_BODY = 8192
PROMPTS = ["Hello there", "The quick brown fox", "Once upon a time"]


@pytest.fixture(scope="module")
def clients(tmp_path_factory, tiny_llama_dir):
    agent_port, http_port, grpc_port = free_ports(3)
    path = write_config(
        tmp_path_factory.mktemp("grpc"),
        tiny_llama_dir,
        [agent_port],
        runtime=LONG_ANSWERS_RUNTIME,
        agents={"restart_policy": "exit"},
        server={"port": http_port, "grpc_port": grpc_port, "api_keys": [KEY], "max_body_bytes": MAX_BODY},
    )
    with serving_stack(path) as (_, server):
        assert f"KServe v2 gRPC on 127.0.0.1:{grpc_port}" in server.output()
        grpc_client = triton_grpc.InferenceServerClient(f"127.0.0.1:{grpc_port}")
        yield grpc_client, triton_http.InferenceServerClient(f"127.0.0.1:{http_port}")
        grpc_client.close()


def inputs(module, prompt: str, **values):
    """text_input and one-element inputs named as the parameters (FP32, INT32, BOOL by type)."""
    text = module.InferInput("text_input", [1], "BYTES")
    text.set_data_from_numpy(np.array([prompt.encode()], dtype=object))
    tensors = [text]
    for name, value in values.items():
        kind, dtype = (
            ("BOOL", np.bool_)
            if isinstance(value, bool)
            else ("INT32", np.int32)
            if isinstance(value, int)
            else ("FP32", np.float32)
        )
        tensor = module.InferInput(name, [1], kind)
        tensor.set_data_from_numpy(np.array([value], dtype=dtype))
        tensors.append(tensor)
    return tensors


def text_of(result) -> str:
    value = result.as_numpy("text_output")[0]  # bytes over gRPC, str from HTTP's JSON
    return value.decode() if isinstance(value, bytes) else value


def http_answer(http, prompt: str, max_tokens: int = 12) -> str:
    reply = http.infer(
        "tiny",
        inputs(triton_http, prompt, max_tokens=max_tokens, temperature=0.0),
        headers=dict(AUTH),  # it adds to the dict
    )
    return text_of(reply)


def test_health_metadata_and_repository(clients):
    grpc_client, _ = clients
    assert grpc_client.is_server_live(headers=AUTH) and grpc_client.is_server_ready(headers=AUTH)
    assert grpc_client.is_model_ready("tiny", headers=AUTH)
    metadata = grpc_client.get_model_metadata("tiny", headers=AUTH, as_json=True)
    assert metadata["inputs"] == [{"name": "text_input", "datatype": "BYTES", "shape": ["1"]}]
    assert grpc_client.get_server_metadata(headers=AUTH).name == "ms-llm-serving"
    index = grpc_client.get_model_repository_index(headers=AUTH, as_json=True)
    assert [(m["name"], m["state"]) for m in index["models"]] == [("tiny", "READY")]
    assert grpc_client.get_model_config("tiny", headers=AUTH).config.name == "tiny"


def test_infer_answers_as_the_http_infer(clients):
    grpc_client, http = clients
    for prompt in PROMPTS:
        expected = http_answer(http, prompt)
        reply = grpc_client.infer(
            "tiny", inputs(triton_grpc, prompt, max_tokens=12, temperature=0.0), headers=AUTH
        )
        assert text_of(reply) == expected
        by_parameters = grpc_client.infer(  # the same as request parameters
            "tiny",
            inputs(triton_grpc, prompt),
            parameters={"max_tokens": 12, "temperature": 0.0},
            headers=AUTH,
        )
        assert text_of(by_parameters) == expected
    full = grpc_client.infer(
        "tiny",
        inputs(triton_grpc, "Hello there", max_tokens=12, temperature=0.0, exclude_input_in_output=False),
        headers=AUTH,
    )
    assert text_of(full) == "Hello there" + http_answer(http, "Hello there")


def test_stream_infer_answers_as_the_http_infer(clients):
    grpc_client, http = clients
    results: queue.Queue = queue.Queue()
    grpc_client.start_stream(callback=lambda result, error: results.put((result, error)), headers=AUTH)
    try:
        for i, prompt in enumerate(PROMPTS):  # side by side on one stream
            grpc_client.async_stream_infer(
                "tiny",
                inputs(triton_grpc, prompt, max_tokens=12, temperature=0.0),
                request_id=str(i),
                enable_empty_final_response=True,
            )
        pieces: dict[str, list[str]] = {str(i): [] for i in range(len(PROMPTS))}
        open_requests = set(pieces)
        while open_requests:
            result, error = results.get(timeout=60)
            assert error is None, error
            response = result.get_response()
            if response.parameters["triton_final_response"].bool_param:
                assert not response.outputs
                open_requests.discard(response.id)
            else:
                pieces[response.id].append(text_of(result))
        for i, prompt in enumerate(PROMPTS):
            assert len(pieces[str(i)]) > 1 and "".join(pieces[str(i)]) == http_answer(http, prompt)

        grpc_client.async_stream_infer(  # a bad request on the stream: an error, the stream goes on
            "tiny", inputs(triton_grpc, "x", temperature=-1.0), request_id="bad"
        )
        result, error = results.get(timeout=60)
        assert result is None and "temperature" in error.message()
    finally:
        grpc_client.stop_stream()


def test_bad_requests_get_grpc_status_codes_with_messages(clients):
    grpc_client, _ = clients

    def refused(call) -> InferenceServerException:
        with pytest.raises(InferenceServerException) as caught:
            call()
        return caught.value

    error = refused(lambda: grpc_client.infer("tiny", inputs(triton_grpc, "x")))
    assert error.status() == "StatusCode.UNAUTHENTICATED" and "API key" in error.message()
    error = refused(lambda: grpc_client.is_server_live(headers={"authorization": "Bearer wrong"}))
    assert error.status() == "StatusCode.UNAUTHENTICATED"
    assert grpc_client.is_server_live(headers={"x-api-key": KEY})
    error = refused(lambda: grpc_client.infer("gpt-5", inputs(triton_grpc, "x"), headers=AUTH))
    assert error.status() == "StatusCode.NOT_FOUND" and "served: tiny" in error.message()
    error = refused(lambda: grpc_client.get_model_metadata("gpt-5", headers=AUTH))
    assert error.status() == "StatusCode.NOT_FOUND"
    for values, word in [
        ({"temperature": -1.0}, "temperature"),
        ({"max_tokens": 100000}, "max_tokens"),
        ({"top_q": 1.0}, "top_q"),
    ]:
        error = refused(
            lambda v=values: grpc_client.infer("tiny", inputs(triton_grpc, "x", **v), headers=AUTH)
        )
        assert error.status() == "StatusCode.INVALID_ARGUMENT" and word in error.message(), error
    no_text = triton_grpc.InferInput("max_tokens", [1], "INT32")
    no_text.set_data_from_numpy(np.array([4], dtype=np.int32))
    error = refused(lambda: grpc_client.infer("tiny", [no_text], headers=AUTH))
    assert error.status() == "StatusCode.INVALID_ARGUMENT" and "text_input" in error.message()
    error = refused(lambda: grpc_client.infer("tiny", inputs(triton_grpc, "x" * MAX_BODY), headers=AUTH))
    assert error.status() == "StatusCode.RESOURCE_EXHAUSTED"
    error = refused(lambda: grpc_client.unload_model("tiny", headers=AUTH))
    assert error.status() == "StatusCode.INVALID_ARGUMENT" and "model_control_mode" in error.message()
    assert grpc_client.is_model_ready("tiny", headers=AUTH)  # nothing above hurt the server
