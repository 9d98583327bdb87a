"""Sampling parameters through a real agent and `start_server.py` on the tiny model, with httpx as the
client, on every API (OpenAI chat and completions, Responses, Anthropic's Messages, native):
min_p and typical_p reach the agent (min_p 1 keeps only the most likely token, so a hot sampled
answer is the greedy one; typical_p changes a seeded answer), their out-of-range values are refused
naming them, and the sampling parameters other servers take and no sampler here implements
(agent/contract/sampling.py's UNSERVED_SAMPLING) are refused naming them, while the values at which
those samplers are off, and unknown fields that are not sampling parameters, are served as before."""

import pytest

from agent_harness import LONG_ANSWERS_RUNTIME, free_ports, serving_stack, write_config
from http_client import post

QUESTION = [{"role": "user", "content": "Hello there"}]
PROMPT = "The capital of France"
APIS = ["chat", "completions", "responses", "messages", "native"]
OPENAI_SHAPED = {"chat", "completions", "responses"}


@pytest.fixture(scope="module")
def base(tmp_path_factory, tiny_llama_dir):
    agent_port, http_port = free_ports(2)
    path = write_config(
        tmp_path_factory.mktemp("sampling"),
        tiny_llama_dir,
        [agent_port],
        runtime=LONG_ANSWERS_RUNTIME,
        server={"port": http_port},
    )
    with serving_stack(path):
        yield f"http://127.0.0.1:{http_port}"


def request(api: str, sampling: dict) -> tuple[str, dict]:
    """The path and body of a short request of `api` with these sampling fields, as that API names
    them (the native API's inside `parameters`)."""
    if api == "chat":
        return "/v1/chat/completions", {"model": "tiny", "messages": QUESTION, "max_tokens": 8, **sampling}
    if api == "completions":
        return "/v1/completions", {"model": "tiny", "prompt": PROMPT, "max_tokens": 8, **sampling}
    if api == "responses":
        return "/v1/responses", {"model": "tiny", "input": "Hello there", "max_output_tokens": 8, **sampling}
    if api == "messages":
        return "/v1/messages", {"model": "tiny", "messages": QUESTION, "max_tokens": 8, **sampling}
    return "/models/tiny/generate", {"inputs": PROMPT, "parameters": {"max_new_tokens": 8, **sampling}}


def send(base: str, api: str, sampling: dict):
    path, body = request(api, sampling)
    return post(base + path, body)


def answer(base: str, api: str, sampling: dict) -> str:
    reply = send(base, api, sampling)
    assert reply.status_code == 200, reply.text
    body = reply.json()
    if api == "chat":
        return body["choices"][0]["message"]["content"]
    if api == "completions":
        return body["choices"][0]["text"]
    if api == "responses":
        return "".join(p["text"] for item in body["output"] for p in item.get("content") or [])
    if api == "messages":
        return "".join(block["text"] for block in body["content"] if block["type"] == "text")
    return body["generated_text"]


def greedy(api: str) -> dict:
    return {"do_sample": False} if api == "native" else {"temperature": 0}


def hot(api: str, **sampling) -> dict:
    """Sampled with seed 3, as hot as the API allows (Anthropic's temperature stops at 1); native
    with no top-k (its default is 3). Responses and Anthropic's carry no seed: the tiny model's
    answer differs from the greedy one anyway."""
    if api == "native":
        return {"do_sample": True, "temperature": 1.5, "top_k": 0, "seed": 3, **sampling}
    if api in ("responses", "messages"):
        return {"temperature": 1.0, **sampling}
    return {"temperature": 1.5, "seed": 3, **sampling}


def refusal(reply, api: str) -> str:
    """The refusal's message, after checking its status and shape (the native API answers 422, as
    TGI does for a bad parameter; the others 400)."""
    assert reply.status_code == (422 if api == "native" else 400), reply.text
    error = reply.json()["error"]
    return error if api == "native" else error["message"]


@pytest.mark.parametrize("api", APIS)
def test_min_p_1_makes_a_hot_answer_the_greedy_one(base, api):
    """min_p 1 keeps only the most likely token: the parameter reached the agent's sampler."""
    plain = answer(base, api, greedy(api))
    if api in ("chat", "completions", "native"):  # seeded: the check means something
        assert answer(base, api, hot(api)) != plain
    assert answer(base, api, hot(api, min_p=1.0)) == plain


@pytest.mark.parametrize("api", ["chat", "completions", "native"])
def test_typical_p_changes_a_seeded_answer(base, api):
    """The same seed draws other tokens once typical_p keeps only the tokens nearest the entropy."""
    seeded = answer(base, api, hot(api))
    assert answer(base, api, hot(api)) == seeded
    assert answer(base, api, hot(api, typical_p=0.05)) != seeded
    assert answer(base, api, hot(api, typical_p=1.0)) == seeded  # 1: off


@pytest.mark.parametrize("api", ["responses", "messages"])
def test_typical_p_is_carried_and_served(base, api):
    assert answer(base, api, hot(api, typical_p=0.5, min_p=0.05))


@pytest.mark.parametrize("api", APIS)
@pytest.mark.parametrize(
    "field, value", [("min_p", -0.1), ("min_p", 1.5), ("typical_p", 0), ("typical_p", 1.5)]
)
def test_out_of_range_min_p_and_typical_p_are_refused_naming_them(base, api, field, value):
    reply = send(base, api, {field: value})
    assert field in refusal(reply, api)
    if api in OPENAI_SHAPED:
        assert reply.json()["error"]["param"] == field


UNSERVED = [
    {"mirostat": 2, "mirostat_tau": 5.0, "mirostat_eta": 0.1},
    {"dry_multiplier": 0.8, "dry_base": 1.75, "dry_allowed_length": 2},
    {"xtc_probability": 0.5, "xtc_threshold": 0.1},
    {"use_beam_search": True, "length_penalty": 0.8, "early_stopping": True},
    {"top_a": 0.2, "tfs_z": 0.95, "top_n_sigma": 1.0},
    {"penalty_alpha": 0.6, "eta_cutoff": 3e-4, "epsilon_cutoff": 3e-4},
    {"dynatemp_range": 0.5, "dynatemp_exponent": 1.0, "repeat_penalty": 1.2, "penalize_nl": True},
    {"best_of": 3, "n_probs": 2},
]


@pytest.mark.parametrize("api", APIS)
@pytest.mark.parametrize("sampling", UNSERVED, ids=lambda s: next(iter(s)))
def test_sampling_parameters_no_sampler_implements_are_refused_naming_them(base, api, sampling):
    if api == "completions" and "best_of" in sampling:
        sampling = {k: v for k, v in sampling.items() if k != "best_of"}  # its own (best_of = n)
    message = refusal(send(base, api, sampling), api)
    assert all(name in message for name in sampling), message
    assert "not supported" in message


@pytest.mark.parametrize("api", ["chat", "completions", "responses", "messages"])
def test_off_values_and_other_unknown_fields_are_served_as_before(base, api):
    """What llama.cpp's clients send by default (every sampler off), and fields that are not
    sampling parameters, ask for nothing this server lacks: the answer is the plain one."""
    off = {
        "mirostat": 0,
        "mirostat_tau": 5.0,
        "mirostat_eta": 0.1,
        "dry_multiplier": 0.0,
        "dry_base": 1.75,
        "xtc_probability": 0.0,
        "xtc_threshold": 0.1,
        "tfs_z": 1.0,
        "top_n_sigma": -1,
        "repeat_last_n": 64,
        "min_p": 0.0,
        "typical_p": 1.0,
        "a_client_field": {"anything": [1, 2]},
    }
    assert answer(base, api, greedy(api) | off) == answer(base, api, greedy(api))


def test_the_native_api_serves_tgi_defaults_and_refuses_a_watermark(base):
    plain = answer(base, "native", greedy("native"))
    assert answer(base, "native", {"typical_p": None, "watermark": False}) == plain
    assert "watermark" in refusal(send(base, "native", {"watermark": True}), "native")
    # every other unknown key is an error there, an off sampler's too
    assert "mirostat" in refusal(send(base, "native", {"mirostat": 0}), "native")


@pytest.mark.parametrize(
    "api, sampling",
    [
        ("responses", {"top_k": 5, "seed": 1}),
        ("responses", {"repetition_penalty": 1.2, "presence_penalty": 0.5}),
        ("messages", {"seed": 1, "frequency_penalty": 0.5}),
        ("messages", {"repetition_penalty": 1.2, "logit_bias": {"5": 10}}),
    ],
)
def test_chat_sampling_parameters_another_api_does_not_carry_are_refused_naming_them(base, api, sampling):
    message = refusal(send(base, api, sampling), api)
    assert all(name in message for name in sampling) and "/v1/chat/completions" in message, message
