"""python -m tools.quality against a real agent + `start_server.py` on the tiny model, with the same
server as its reference: no divergence and full top-1 agreement; its perplexity is the one computed
here from the logprobs the API's echo gives for the same window (the tool reads vLLM's
prompt_logprobs, so the two shapes are checked against each other too)."""

import json
import math

import httpx
import pytest

from agent_harness import LONG_ANSWERS_RUNTIME, free_ports, serving_stack, write_config
from tools.quality.__main__ import DEFAULT_TEXT, main

WINDOW = 64


@pytest.fixture(scope="module")
def base(tmp_path_factory, tiny_llama_dir):
    agent_port, http_port = free_ports(2)
    path = write_config(
        tmp_path_factory.mktemp("quality"),
        tiny_llama_dir,
        [agent_port],
        runtime=LONG_ANSWERS_RUNTIME,
        server={"port": http_port},
    )
    with serving_stack(path):
        yield f"http://127.0.0.1:{http_port}"


def run_tool(tmp_path, *argv: str) -> dict:
    assert (
        main([*argv, "--model", "tiny", "--window", str(WINDOW), "--out", str(tmp_path), "--name", "q"]) == 0
    )
    return json.loads((tmp_path / "q.json").read_text())


def test_the_same_server_as_reference_agrees_with_itself(base, tmp_path, capsys):
    result = run_tool(
        tmp_path,
        "--target",
        f"{base}/v1",
        "--reference",
        f"{base}/v1",
        "--stride",
        "32",
        "--max-windows",
        "3",
    )
    # the first window scores all but its first token, the next two the 32 tokens past the last
    assert result["tokens_scored"] == (WINDOW - 1) + 32 + 32 and result["windows"] == 3
    assert result["text_tokens"] > 1000  # the shipped text, tokenized by the server
    assert result["kl_mean"] < 1e-6 and result["kl_p99"] < 1e-6
    assert result["top1_agreement"] == 1.0
    assert math.isfinite(result["perplexity"]) and result["perplexity"] > 1
    assert result["reference_perplexity"] == result["perplexity"]
    printed = capsys.readouterr().out
    assert "| top-1 agreement | 1.0000 |" in printed and "| tokens scored | 127 |" in printed


def test_perplexity_is_that_of_the_api_logprobs(base, tmp_path):
    result = run_tool(tmp_path, "--target", f"{base}/v1", "--max-windows", "1")
    assert result["tokens_scored"] == WINDOW - 1 and "kl_mean" not in result
    text = DEFAULT_TEXT.read_text(encoding="utf-8")[:1000]  # the tool's first piece holds this much
    reply = httpx.post(
        f"{base}/tokenize", json={"model": "tiny", "prompt": text, "add_special_tokens": False}, timeout=60
    )
    ids = reply.json()["tokens"][:WINDOW]
    body = {"model": "tiny", "prompt": ids, "echo": True, "max_tokens": 0, "logprobs": 0}
    reply = httpx.post(f"{base}/v1/completions", json=body, timeout=120)
    values = reply.json()["choices"][0]["logprobs"]["token_logprobs"]
    assert values[0] is None and len(values) == WINDOW
    assert result["perplexity"] == pytest.approx(math.exp(-sum(values[1:]) / (WINDOW - 1)), rel=1e-6)


def test_a_model_the_server_does_not_serve_ends_with_a_message(base, tmp_path, capsys):
    argv = ["--target", f"{base}/v1", "--model", "absent", "--out", str(tmp_path)]
    assert main(argv) == 1
    assert "404" in capsys.readouterr().err and not list(tmp_path.glob("*.json"))
