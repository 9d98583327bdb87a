"""Triton's HTTP API (server/triton_api.py) with Triton's own client, `tritonclient[http]`, against a
real agent + server on the tiny model: KServe v2 infer (binary and JSON tensors), metadata,
readiness, and the generate extension."""

import json

import httpx
import numpy as np
import pytest
import tritonclient.http as triton
from httpx_sse import connect_sse
from tritonclient.utils import InferenceServerException

from agent_harness import free_ports, serving_stack, write_config

PROMPT = "Once upon a time"


@pytest.fixture(scope="module")
def stack(tmp_path_factory, tiny_llama_dir):
    agent_port, http_port = free_ports(2)
    path = write_config(
        tmp_path_factory.mktemp("triton"), tiny_llama_dir, [agent_port], server={"port": http_port}
    )
    with serving_stack(path):
        yield f"127.0.0.1:{http_port}"


def native_answer(address: str, max_tokens: int) -> str:
    body = {"inputs": PROMPT, "parameters": {"max_new_tokens": max_tokens}}
    return httpx.post(f"http://{address}/models/tiny/generate", json=body, timeout=60).json()[
        "generated_text"
    ]


def prompt_input(binary: bool) -> list:
    text = triton.InferInput("text_input", [1], "BYTES")
    text.set_data_from_numpy(np.array([PROMPT.encode()], dtype=object), binary_data=binary)
    tokens = triton.InferInput("max_tokens", [1], "INT32")
    tokens.set_data_from_numpy(np.array([8], np.int32), binary_data=binary)
    temperature = triton.InferInput("temperature", [1], "FP32")
    temperature.set_data_from_numpy(np.array([0.0], np.float32), binary_data=binary)
    return [text, tokens, temperature]


@pytest.mark.parametrize("binary", [True, False])
def test_the_triton_client_infers_and_reads_metadata(stack, binary):
    client = triton.InferenceServerClient(stack)
    assert client.is_server_live() and client.is_server_ready() and client.is_model_ready("tiny")
    metadata = client.get_model_metadata("tiny")
    assert [i["name"] for i in metadata["inputs"]] == ["text_input"] and metadata["versions"] == ["1"]
    # Without outputs named, tritonclient asks for them all (request parameter binary_data_output).
    outputs = [triton.InferRequestedOutput("text_output")] if binary else None
    result = client.infer("tiny", prompt_input(binary), outputs=outputs)
    [text] = result.as_numpy("text_output")
    assert (text.decode() if isinstance(text, bytes) else text) == native_answer(stack, 8)
    with pytest.raises(InferenceServerException, match="served: tiny"):
        client.infer("gpt-5", prompt_input(binary))
    client.close()


def test_generate_and_generate_stream_answer_as_the_native_api(stack):
    base, want = f"http://{stack}", native_answer(stack, 8)
    body = {"text_input": PROMPT, "parameters": {"max_tokens": 8, "temperature": 0}}
    reply = httpx.post(f"{base}/v2/models/tiny/generate", json=body, timeout=60).json()
    assert reply == {"model_name": "tiny", "model_version": "1", "text_output": want}
    with (
        httpx.Client(timeout=60) as client,
        connect_sse(client, "POST", f"{base}/v2/models/tiny/generate_stream", json=body) as events,
    ):
        pieces = [json.loads(e.data) for e in events.iter_sse()]
    assert "".join(p["text_output"] for p in pieces) == want and {p["model_name"] for p in pieces} == {"tiny"}
    body["parameters"]["exclude_input_in_output"] = False
    assert (
        httpx.post(f"{base}/v2/models/tiny/generate", json=body, timeout=60).json()["text_output"]
        == PROMPT + want
    )


def test_bad_triton_requests_name_the_problem(stack):
    base = f"http://{stack}/v2/models/tiny"
    one = {"name": "text_input", "shape": [1], "datatype": "BYTES", "data": [PROMPT]}
    for body, headers, word in [
        ({"inputs": [{**one, "name": "prompt_text"}]}, {}, "text_input"),
        (
            {"inputs": [one, {"name": "beam_width", "shape": [1], "datatype": "INT32", "data": [4]}]},
            {},
            "beam_width",
        ),
        ({"inputs": [{**one, "shape": [2], "data": ["a", "b"]}]}, {}, "one element"),
        (
            {"inputs": [{**one, "data": None, "parameters": {"binary_data_size": 99}}]},
            {"Inference-Header-Content-Length": "0"},
            "outside the body",
        ),
        ({"inputs": []}, {}, "KServe"),
    ]:
        reply = httpx.post(f"{base}/infer", content=json.dumps(body), headers=headers, timeout=30)
        assert reply.status_code == 400 and word in reply.json()["error"], reply.text
    reply = httpx.post(f"{base}/generate", json={"text_input": "x", "parameters": {"beams": 2}}, timeout=30)
    assert reply.status_code == 400 and "beams" in reply.json()["error"]


def test_the_one_model_server_lists_its_model_and_refuses_loads(stack):
    """model_control_mode none (every existing config): the repository API shows the model; loads
    and unloads are refused, naming the setting."""
    base = f"http://{stack}"
    index = httpx.post(f"{base}/v2/repository/index", timeout=30)
    assert index.json() == [{"name": "tiny", "version": "1", "state": "READY", "reason": ""}]
    for action in ("load", "unload"):
        reply = httpx.post(f"{base}/v2/repository/models/tiny/{action}", timeout=30)
        assert reply.status_code == 400 and "model_control_mode is none" in reply.json()["error"]
    client = triton.InferenceServerClient(stack)
    with pytest.raises(InferenceServerException, match="model_control_mode is none"):
        client.unload_model("tiny")
    client.close()
