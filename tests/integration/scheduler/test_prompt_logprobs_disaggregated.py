"""Prompt logprobs under PD disaggregation, with real processes: the prefill agent computes the
whole prompt with its positions scored and sends the KV on; the prompt's logprobs of a greedy
answer's tokens equal the logprobs that answer reported (its first token sampled on the prefill
agent, the rest on the decode agent)."""

import httpx
import pytest

from agent.model.tokenizer import load_tokenizer
from agent_harness import free_ports, serving_stack, write_config


@pytest.fixture(scope="module")
def base(tmp_path_factory, tiny_llama_dir):
    ports = free_ports(3)
    groups = [{"role": "prefill", "ports": [ports[0]]}, {"role": "decode", "ports": [ports[1]]}]
    path = write_config(
        tmp_path_factory.mktemp("pd-prompt-logprobs"),
        tiny_llama_dir,
        ports[:2],
        agents={"groups": groups},
        server={"port": ports[2]},
    )
    with serving_stack(path):
        yield f"http://127.0.0.1:{ports[2]}"


def test_prompt_logprobs_of_a_greedy_answer_equal_its_logprobs(base, tiny_llama_dir):
    tokenizer = load_tokenizer(tiny_llama_dir)
    body = {
        "inputs": "The quick brown fox",
        "parameters": {
            "max_new_tokens": 6,
            "details": True,
            "ignore_eos": True,
            "decoder_input_details": True,
        },
    }
    reply = httpx.post(f"{base}/models/tiny/generate", json=body, timeout=120)
    assert reply.status_code == 200, reply.text
    details = reply.json()["details"]
    prompt = tokenizer.encode("The quick brown fox")
    assert [t["id"] for t in details["prefill"]] == prompt and details["prefill"][0]["logprob"] is None
    generated = [t["id"] for t in details["tokens"]]
    echo = {"model": "tiny", "prompt": prompt + generated, "echo": True, "max_tokens": 0, "logprobs": 0}
    reply = httpx.post(f"{base}/v1/completions", json=echo, timeout=120)
    assert reply.status_code == 200, reply.text
    scored = reply.json()["choices"][0]["logprobs"]["token_logprobs"]
    assert scored[1 : len(prompt)] == pytest.approx([t["logprob"] for t in details["prefill"][1:]], abs=1e-4)
    assert scored[len(prompt) :] == pytest.approx([t["logprob"] for t in details["tokens"]], abs=1e-3)
