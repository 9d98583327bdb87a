"""Qwen3-MoE under runtime.activations int8 (issues 57, 58): a tiny qwen3moe GGUF of tools.make_gguf
(Q4_K_M: experts Q4_K, the last layer's ffn_down_exps Q6_K, the router F32) runs its experts through
MoeFfnI8 (agent/kernels/moe.cc: the integer experts' inputs rounded per block of 32, as the dense
layers' int8 products round theirs) beside the fused int8 attention. It passes the warm-up's
known-answer check, answers alike alone and in a decode batch (each row's int8 products and routing
sum alike at every row count), and served by start_agent.py / start_server.py it starts and answers
/v1/completions at temperature 0 with those answers. The op's numbers against a reference are
tests/unit/agent/test_moe_kernel.py's."""

from pathlib import Path

import pytest

import runner_calls as calls
from agent.contract.sampling import SamplingParams
from agent.known_answer import KnownAnswer
from agent.model.formats import load_checkpoint
from agent.model.tokenizer import load_tokenizer
from agent.runner import ModelRunner
from agent.warm_up import warm_up
from agent_harness import LONG_ANSWERS_RUNTIME, free_ports, serving_stack, write_config
from config.schema import RuntimeSection
from http_client import greedy_completions
from tools.make_gguf import Shape, mix, write_random_gguf

INT8_RUNTIME = {**LONG_ANSWERS_RUNTIME, "activations": "int8"}
NEW_TOKENS = 8
TEXTS = ("The capital of France is", "Once upon a time", "def fibonacci(n):", "Rain fell on the")


@pytest.fixture(scope="module")
def moe_gguf(tmp_path_factory, default_model_path) -> Path:
    shape = Shape(256, 2, 512, 4, 2, arch="qwen3moe", head_dim=64, experts=8, experts_used=2, expert_ffn=256)
    path = tmp_path_factory.mktemp("qwen3moe-int8") / "moe.gguf"
    return write_random_gguf(path, shape, mix("Q4_K_M"), default_model_path, embed_scale=1.0)


@pytest.fixture(scope="module")
def prompts(moe_gguf) -> list[list[int]]:
    tokenizer = load_tokenizer(moe_gguf)
    return [tokenizer.encode(text) for text in TEXTS]


@pytest.fixture(scope="module")
def int8_answers(moe_gguf, prompts) -> list[list[int]]:
    """Each prompt's greedy answer alone, in process, after the warm-up's known-answer check."""
    checkpoint = load_checkpoint(moe_gguf)
    runner = ModelRunner.from_checkpoint(checkpoint, RuntimeSection.model_validate(INT8_RUNTIME))
    layers = runner.graphs.model.layers
    ops = {layer.moe.op.func.rsplit(":", 1)[1] for layer in layers if layer.moe is not None}
    assert ops == {"MoeFfnI8"} and all(layer.moe is not None for layer in layers)  # int8 experts
    warm_up(runner, known=KnownAnswer.of_checkpoint(checkpoint, runner.runtime))
    answers = []
    for prompt in prompts:
        got = [calls.prefill(runner, 0, prompt, SamplingParams())]
        got += [calls.decode(runner, [0])[0] for _ in range(NEW_TOKENS - 1)]
        runner.release(0)
        answers.append(got)
    # decoded together, the rows' experts grouped in one op call each step: each its answer alone
    together = [
        [calls.prefill(runner, slot, prompt, SamplingParams())] for slot, prompt in enumerate(prompts)
    ]
    for _ in range(NEW_TOKENS - 1):
        for answer, token in zip(together, calls.decode(runner, list(range(len(prompts))))):
            answer.append(token)
    assert together == answers
    return answers


def test_int8_experts_pass_the_known_answer_check_and_answer_alike_in_a_batch(int8_answers):
    assert len({tuple(a) for a in int8_answers}) > 1  # the prompts lead to different answers


def test_the_served_int8_stack_starts_and_answers_greedily(moe_gguf, prompts, int8_answers, tmp_path):
    """start_agent.py (its memory plan, warm-up and known-answer check with int8 activations) and
    start_server.py: temperature-0 completions of the token prompts are the in-process answers."""
    tokenizer = load_tokenizer(moe_gguf)
    agent_port, http_port = free_ports(2)
    config = write_config(tmp_path, moe_gguf, [agent_port], runtime=INT8_RUNTIME, server={"port": http_port})
    with serving_stack(config):
        texts = greedy_completions(f"http://127.0.0.1:{http_port}", prompts, NEW_TOKENS)
    assert texts == [tokenizer.decode(answer) for answer in int8_answers]
