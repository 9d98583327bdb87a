"""Prompt logprobs and token-id prompts over HTTP, against a real agent + `start_server.py` on the
tiny model: /v1/completions' echo (whole and streamed) and vLLM's prompt_logprobs, TGI's
decoder_input_details, prompts as token ids and lists of prompts.

The reference is the model's own greedy generation: the logprobs it reports for the tokens it
generates (one decode step each) must be the prompt logprobs of the same tokens sent back as a
prompt. The scheduler's token budget (40 positions a step) computes a long prompt in several chunks,
so a prompt's positions are scored across chunk boundaries (each chunk's last row at the next
chunk's first token); tests/integration/agent/test_prompt_logprobs.py compares chunked with whole
on the runner itself."""

import json

import httpx
import pytest

from agent.model.tokenizer import load_tokenizer
from agent_harness import LONG_ANSWERS_RUNTIME, free_ports, serving_stack, write_config

LONG_PROMPT = "Once upon a time, in a land far away, there lived a small dragon who loved to read books."
TOLERANCE = 1e-3


@pytest.fixture(scope="module")
def base(tmp_path_factory, tiny_llama_dir):
    agent_port, http_port = free_ports(2)
    path = write_config(
        tmp_path_factory.mktemp("prompt-logprobs"),
        tiny_llama_dir,
        [agent_port],
        runtime=LONG_ANSWERS_RUNTIME,
        scheduler={"max_num_batched_tokens": 40},  # a prompt of more positions runs in chunks
        server={"port": http_port},
    )
    with serving_stack(path):
        yield f"http://127.0.0.1:{http_port}"


@pytest.fixture(scope="module")
def tokenizer(tiny_llama_dir):
    return load_tokenizer(tiny_llama_dir)


def post(base: str, path: str, body: dict, status: int = 200) -> dict:
    reply = httpx.post(f"{base}{path}", json=body, timeout=120)
    assert reply.status_code == status, reply.text
    return reply.json()


def complete(base: str, **body) -> dict:
    return post(base, "/v1/completions", {"model": "tiny", "temperature": 0, **body})


def streamed(base: str, **body) -> list[dict]:
    """The SSE chunks of a streamed completion, [DONE] left out."""
    chunks = []
    with httpx.stream(
        "POST",
        f"{base}/v1/completions",
        json={"model": "tiny", "temperature": 0, "stream": True, **body},
        timeout=120,
    ) as reply:
        assert reply.status_code == 200
        for line in reply.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[len("data: ") :]))
    return chunks


def greedy(base: str, prompt: str, n: int) -> dict:
    """The native API's greedy answer with each token's id, logprob and 2 best (TGI details)."""
    body = {
        "inputs": prompt,
        "parameters": {"max_new_tokens": n, "details": True, "top_n_tokens": 2, "ignore_eos": True},
    }
    return post(base, "/models/tiny/generate", body)["details"]


def test_echo_logprobs_of_prompt_equal_greedy_logprobs(base, tokenizer):
    details = greedy(base, LONG_PROMPT, 8)
    prompt = tokenizer.encode(LONG_PROMPT)
    generated = [t["id"] for t in details["tokens"]]
    assert len(prompt) + len(generated) > 80  # three chunks at least
    reply = complete(base, prompt=prompt + generated, echo=True, max_tokens=0, logprobs=2)
    [choice] = reply["choices"]
    assert choice["finish_reason"] == "length"
    assert reply["usage"] == {
        "prompt_tokens": len(prompt) + len(generated),
        "completion_tokens": 0,
        "total_tokens": len(prompt) + len(generated),
    }
    assert choice["text"] == tokenizer.decode(prompt + generated)
    logprobs = choice["logprobs"]
    assert logprobs["tokens"] == [tokenizer.token_piece(t)[0] for t in prompt + generated]
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    assert logprobs["text_offset"][:2] == [0, len(logprobs["tokens"][0])]
    tail = logprobs["token_logprobs"][len(prompt) :]
    for value, token in zip(tail, details["tokens"]):
        assert value == pytest.approx(token["logprob"], abs=TOLERANCE)
    for shown, top in zip(logprobs["top_logprobs"][len(prompt) :], details["top_tokens"]):
        expected = {t["text"]: t["logprob"] for t in top}  # a text two tokens share is one key
        assert list(shown) == list(expected)
        assert list(shown.values()) == pytest.approx(list(expected.values()), abs=TOLERANCE)
    assert all(v is not None and v <= 0 for v in logprobs["token_logprobs"][1:])

    # the same prompt streamed: the prompt part first, with the same values
    chunks = streamed(base, prompt=prompt + generated, echo=True, max_tokens=0, logprobs=2)
    text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
    assert text == choice["text"]
    shown = [c["choices"][0]["logprobs"] for c in chunks if c["choices"] and c["choices"][0]["logprobs"]]
    assert shown[0]["token_logprobs"] == logprobs["token_logprobs"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_echo_with_generation_and_prompt_logprobs(base, tokenizer):
    prompt = tokenizer.encode("The cat sat")
    plain = complete(base, prompt="The cat sat", max_tokens=5, logprobs=1)["choices"][0]
    reply = complete(base, prompt="The cat sat", max_tokens=5, logprobs=1, echo=True, prompt_logprobs=3)
    [choice] = reply["choices"]
    assert choice["text"] == "The cat sat" + plain["text"]
    logprobs = choice["logprobs"]
    n = len(prompt)
    assert logprobs["tokens"][n:] == plain["logprobs"]["tokens"]
    assert logprobs["token_logprobs"][n:] == pytest.approx(plain["logprobs"]["token_logprobs"], abs=TOLERANCE)
    # the generated tokens' offsets follow the echoed prompt's tokens
    assert logprobs["text_offset"][n] == sum(len(t) for t in logprobs["tokens"][:n])
    assert all(len(top) <= 1 for top in logprobs["top_logprobs"][1:])
    # vLLM's prompt_logprobs: None, then each position's token (with its rank) and its 3 best
    scored = choice["prompt_logprobs"]
    assert len(scored) == n and scored[0] is None
    for position, entry in enumerate(scored[1:], start=1):
        token = str(prompt[position])
        assert entry[token]["logprob"] == pytest.approx(logprobs["token_logprobs"][position], abs=1e-6)
        assert entry[token]["decoded_token"] == tokenizer.token_piece(prompt[position])[0]
        ranks = sorted(e["rank"] for e in entry.values())
        assert ranks[:3] == [1, 2, 3] and len(entry) in (3, 4)
        best = [e for e in entry.values() if e["rank"] == 1][0]["logprob"]
        assert all(e["logprob"] <= best for e in entry.values())


def test_streamed_prompt_logprobs_come_with_the_first_chunk(base):
    chunks = streamed(base, prompt="Hello there", max_tokens=3, prompt_logprobs=1)
    first = chunks[0]["choices"][0]
    assert first["prompt_logprobs"][0] is None and len(first["prompt_logprobs"]) > 1
    assert all("prompt_logprobs" not in c["choices"][0] for c in chunks[1:] if c["choices"])


def test_token_id_prompts_and_lists_of_prompts(base, tokenizer):
    texts = ["Once upon", "The dog"]
    alone = [complete(base, prompt=t, max_tokens=6)["choices"][0]["text"] for t in texts]
    ids = [tokenizer.encode(t) for t in texts]
    assert complete(base, prompt=ids[0], max_tokens=6)["choices"][0]["text"] == alone[0]
    for prompts in (texts, ids):
        reply = complete(base, prompt=prompts, max_tokens=6, n=2)
        assert [c["index"] for c in reply["choices"]] == [0, 1, 2, 3]
        assert [c["text"] for c in reply["choices"]] == [alone[0], alone[0], alone[1], alone[1]]
        assert reply["usage"]["prompt_tokens"] == sum(map(len, ids))
    # streamed: each choice's chunks under its index
    chunks = streamed(base, prompt=texts, max_tokens=6)
    joined = ["", ""]
    for chunk in chunks:
        for c in chunk["choices"]:
            joined[c["index"]] += c["text"]
    assert joined == alone


def test_bad_prompts_are_refused(base, tokenizer):
    vocab = tokenizer.vocab_size
    for prompt, word in [
        ([1, vocab], "outside the vocabulary"),
        ([[1, 2], [-1]], "outside the vocabulary"),
        ([], "prompt"),
        ([[1], []], "prompt"),
        (["a"] * 17, "prompt"),
        ([1, "a"], "prompt"),
    ]:
        reply = post(base, "/v1/completions", {"model": "tiny", "prompt": prompt}, 400)
        assert word in json.dumps(reply), (prompt, reply)
    reply = post(base, "/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": 0}, 400)
    assert "max_tokens" in json.dumps(reply)
    body = {"model": "tiny", "prompt": "x", "prompt_logprobs": 21}
    assert "prompt_logprobs" in json.dumps(post(base, "/v1/completions", body, 400))
    too_long = {"model": "tiny", "prompt": [5] * 600, "max_tokens": 1}
    assert httpx.post(f"{base}/v1/completions", json=too_long, timeout=60).status_code in (400, 413)


def test_decoder_input_details_gives_the_prefill(base, tokenizer):
    prompt = "The cat sat on the mat"
    body = {
        "inputs": prompt,
        "parameters": {"max_new_tokens": 2, "details": True, "decoder_input_details": True},
    }
    details = post(base, "/models/tiny/generate", body)["details"]
    ids = tokenizer.encode(prompt)
    assert [t["id"] for t in details["prefill"]] == ids
    assert [t["text"] for t in details["prefill"]] == [tokenizer.token_piece(t)[0] for t in ids]
    assert details["prefill"][0]["logprob"] is None
    echo = complete(base, prompt=prompt, echo=True, max_tokens=0, logprobs=0)["choices"][0]["logprobs"]
    assert [t["logprob"] for t in details["prefill"][1:]] == pytest.approx(
        echo["token_logprobs"][1:], abs=1e-6
    )
    # without decoder_input_details the prefill stays empty; streamed, it is refused (as TGI)
    body["parameters"]["decoder_input_details"] = False
    assert post(base, "/models/tiny/generate", body)["details"]["prefill"] == []
    body["parameters"]["decoder_input_details"] = True
    refused = httpx.post(f"{base}/models/tiny/generate_stream", json=body, timeout=60)
    assert refused.status_code == 422 and "decoder_input_details" in refused.text


def test_chat_prompt_logprobs(base):
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "Hi"}],
        "max_tokens": 2,
        "prompt_logprobs": 0,
    }
    [choice] = post(base, "/v1/chat/completions", body)["choices"]
    scored = choice["prompt_logprobs"]
    assert scored[0] is None and len(scored) > 2
    assert all(len(entry) == 1 and next(iter(entry.values()))["logprob"] <= 0 for entry in scored[1:])
