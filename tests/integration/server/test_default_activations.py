"""runtime.activations auto, the default, as a user meets it: the default model (a Q4_1 GGUF) served
with no activations key runs int8 activations on a CPU with integer dot products, says so in its
log, and answers as the int8 runner does in-process (whose answers test_model_reference holds to the
numpy reference that rounds each product's input to Q8_1, llama.cpp's arithmetic for the file)."""

import pytest
import yaml

import runner_calls as calls
from agent.contract.sampling import SamplingParams
from agent.kernels import has_int8_products
from agent.model.formats import load_checkpoint
from agent.model.tokenizer import load_tokenizer
from agent.runner import ModelRunner
from agent_harness import free_ports, serving_stack, write_config
from config.schema import RuntimeSection
from http_client import post

pytestmark = pytest.mark.default_model
QUESTIONS = ["What is the capital of France?", "Write a haiku about the sea."]
NEW_TOKENS = 8


def int8_answer(runner: ModelRunner, prompt: list[int]) -> list[int]:
    answer = [calls.prefill(runner, 0, prompt, SamplingParams())]
    while len(answer) < NEW_TOKENS:
        answer += calls.decode(runner, [0])
    runner.release(0)
    return answer


@pytest.mark.skipif(not has_int8_products(), reason="auto picks int8 only with AVX2 or AVX512-VNNI products")
def test_the_default_model_runs_int8_by_default_and_answers_as_the_int8_runner(tmp_path, default_model_path):
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
        replies = [
            post(
                f"http://127.0.0.1:{http_port}/models/smollm2/generate",
                {"inputs": question, "parameters": {"chat_template": True, "max_new_tokens": NEW_TOKENS}},
            )
            for question in QUESTIONS
        ]
    log = (tmp_path / "logs" / "agent_0.log").read_text()
    assert "activations: int8, chosen by auto: Q4_1 layer matrices" in log, log
    served = yaml.safe_load(path.read_text())["runtime"]
    runtime = RuntimeSection.model_validate({**served, "activations": "int8"})
    runner = ModelRunner.from_checkpoint(load_checkpoint(default_model_path), runtime)
    tokenizer = load_tokenizer(default_model_path)
    for question, reply in zip(QUESTIONS, replies):
        prompt = tokenizer.encode_chat([{"role": "user", "content": question}])
        want = tokenizer.decode(int8_answer(runner, prompt))
        assert reply.status_code == 200 and reply.json()["generated_text"] == want, (question, reply.text)
