"""runtime.activations auto, the default, as a user meets it: the default model (a Q4_1 GGUF) served
with no activations key runs int8 activations on a CPU with integer dot products, says so in its
log, and answers as the independent numpy reference that rounds each product's input to Q8_1
(llama.cpp's arithmetic for the file)."""

import numpy as np
import pytest

import reference_numpy as ref
from agent.kernels import has_int8_products
from agent.model.tokenizer import load_tokenizer
from agent_harness import free_ports, serving_stack, write_config
from http_client import post

pytestmark = pytest.mark.default_model
QUESTION = "What is the capital of France?"
NEW_TOKENS = 8


def int8_greedy(reference, prompt: list[int], steps: int) -> list[int]:
    cache = ref.RefCache()
    tokens = [int(np.argmax(ref.forward(reference, prompt, cache, int8=True)[-1]))]
    while len(tokens) < steps:
        tokens.append(int(np.argmax(ref.forward(reference, [tokens[-1]], cache, int8=True)[-1])))
    return tokens


@pytest.mark.skipif(not has_int8_products(), reason="auto picks int8 only with integer dot products")
def test_the_default_model_runs_int8_by_default_and_answers_as_the_int8_reference(
    tmp_path, default_model_path
):
    agent_port, http_port = free_ports(2)
    path = write_config(
        tmp_path,
        default_model_path,
        [agent_port],
        model={"name": "smollm2"},
        runtime={"num_slots": 2, "max_seq_len": 64, "prefill_buckets": [64], "decode_batch_buckets": [1, 2]},
        server={"port": http_port},
    )
    with serving_stack(path, agents_timeout=300):
        reply = post(
            f"http://127.0.0.1:{http_port}/models/smollm2/generate",
            {"inputs": QUESTION, "parameters": {"chat_template": True, "max_new_tokens": NEW_TOKENS}},
        )
    log = (tmp_path / "logs" / "agent_0.log").read_text()
    assert "activations: int8, chosen by auto: Q4_1 layer matrices" in log, log
    tokenizer = load_tokenizer(default_model_path)
    prompt = tokenizer.encode_chat([{"role": "user", "content": QUESTION}])
    reference = ref.load_gguf_reference(default_model_path)
    want = int8_greedy(reference, prompt, NEW_TOKENS)
    assert reply.status_code == 200 and reply.json()["generated_text"] == tokenizer.decode(want)
    assert want != ref.greedy(reference, prompt, NEW_TOKENS)  # int8 did answer differently here
