"""A hybrid model (a tiny Qwen3.5 built by transformers, written to GGUF: three Gated DeltaNet layers
and a gated attention layer) served by a real agent and `start_server.py`: its per-sequence states
through the whole stack. A prompt asked again resumes from the state snapshot its first run saved
(a prefix-cache hit the agent restores) and answers exactly as the cold run did; a conversation's
next turn resumes from the first turn's snapshot; n-gram speculation verifies proposals on held
states and every answer equals the same request's with speculation opted out; a small KV pool
preempts, recomputing from snapshots, and loses nothing. /info and /metrics show the snapshots.
Disaggregated (a prefill agent and a decode agent), each prompt's states go with its K/V and the
answers are the mixed agent's."""

from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

import hf_reference as hf
from agent_harness import free_ports, serving_stack, write_config

# repeats itself: what prompt lookup proposes from; 90+ tokens: several blocks of 16
PROMPT = "one two three four five six seven eight nine ten, " * 9
SPECULATION = {"method": "ngram", "num_tokens": 3, "ngram_min": 1, "ngram_max": 3, "adaptive": False}
RUNTIME = {
    "num_slots": 4,
    "max_seq_len": 256,
    "num_blocks": 28,  # one sequence of 256, and some: 4 long answers at once preempt
    "block_size": 16,
    "prefill_buckets": [16, 64],
    "decode_batch_buckets": [1, 2, 4],
    "attend_buckets": [64, 256],
    "speculation": SPECULATION,
    "state_snapshots": 4,
}


def echoing_model(directory):
    """The tiny Qwen3.5 with its LM head the embedding and its layers' outputs 1.2x: its greedy
    answers repeat tokens for a while, then move on (random weights never repeat one, and prompt
    lookup would propose nothing): proposals both kept and rejected."""
    import torch

    model = hf.build("qwen35", directory, seed=0)
    with torch.no_grad():
        model.lm_head.weight.copy_(model.model.embed_tokens.weight)
        for name, weight in model.named_parameters():
            if name.endswith(("o_proj.weight", "out_proj.weight", "down_proj.weight")):
                weight.mul_(1.2)
    model.save_pretrained(directory, safe_serialization=True)
    return hf.write_gguf(directory, directory / "qwen35.gguf", "qwen35")


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return echoing_model(tmp_path_factory.mktemp("qwen35"))


@pytest.fixture(scope="module")
def base(model):
    directory, gguf = model.parent, model
    agent_port, http_port = free_ports(2)
    path = write_config(directory, gguf, [agent_port], runtime=RUNTIME, server={"port": http_port})
    with serving_stack(path):
        yield f"http://127.0.0.1:{http_port}"


@pytest.fixture(scope="module")
def disaggregated(model, tmp_path_factory):
    """A prefill agent and a decode agent: each prompt's K/V and Gated DeltaNet states go from one
    to the other."""
    ports = free_ports(3)
    groups = [{"role": "prefill", "ports": [ports[0]]}, {"role": "decode", "ports": [ports[1]]}]
    runtime = {**RUNTIME, "num_blocks": 64}
    path = write_config(
        tmp_path_factory.mktemp("pd"),
        model,
        ports[:2],
        runtime=runtime,
        agents={"groups": groups},
        server={"port": ports[2]},
    )
    with serving_stack(path):
        yield f"http://127.0.0.1:{ports[2]}"


def metric(base: str, name: str, **labels) -> float:
    text = httpx.get(f"{base}/metrics", timeout=30).text
    return sum(
        s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
    )


def complete(base: str, prompt: str, **extra) -> str:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 12, "temperature": 0, **extra}
    reply = httpx.post(f"{base}/v1/completions", json=body, timeout=120)
    assert reply.status_code == 200, reply.text
    return reply.json()["choices"][0]["text"]


def test_a_prompt_asked_again_resumes_from_its_snapshot(base):
    groups = httpx.get(f"{base}/info", timeout=30).json()["groups"]
    assert groups[0]["state_snapshots"]["snapshots"] == 4
    restores = metric(base, "llm_serving_state_restores_total")
    cold = complete(base, PROMPT, speculate=False)
    held = metric(base, "llm_serving_state_snapshots", state="held")
    assert held >= 1  # its last block boundary's state
    hits = metric(base, "llm_serving_prefix_cache_hits_total")
    again = complete(base, PROMPT, speculate=False)
    assert again == cold
    assert metric(base, "llm_serving_state_restores_total") == restores + 1
    assert metric(base, "llm_serving_prefix_cache_hits_total") - hits >= 80  # 5 blocks of 16
    # the next turn of a conversation: the first turn's prompt and answer, and more
    turn = PROMPT + cold + " and then eleven twelve"
    assert complete(base, turn, speculate=False) == complete(base, turn, speculate=False, cache_salt="cold")


def test_speculation_on_held_states_answers_as_without_it(base):
    proposed = metric(base, "llm_serving_spec_proposed_tokens_total")
    kept = metric(base, "llm_serving_spec_accepted_tokens_total")
    for prompt in (PROMPT, "alpha beta gamma alpha beta gamma alpha beta", "zq8 #x! 4@m"):
        want = complete(base, prompt, speculate=False, max_tokens=30)
        assert complete(base, prompt, max_tokens=30) == want
    proposed = metric(base, "llm_serving_spec_proposed_tokens_total") - proposed
    kept = metric(base, "llm_serving_spec_accepted_tokens_total") - kept
    assert 0 < kept < proposed  # some kept, some rejected: the states held and replayed both ways


def test_preemption_on_a_small_pool_loses_nothing(base):
    """Four long answers at once outgrow the pool of 28 blocks: some are preempted and recomputed
    (from a snapshot where one holds their prefix); each answer equals its answer alone."""
    prompts = [f"{PROMPT} variant {i}" for i in range(4)]
    alone = [complete(base, p, max_tokens=120, speculate=False) for p in prompts]
    preempted = metric(base, "llm_serving_preemptions_total")
    with ThreadPoolExecutor(4) as pool:
        together = list(pool.map(lambda p: complete(base, p, max_tokens=120, speculate=False), prompts))
    assert together == alone
    assert metric(base, "llm_serving_preemptions_total") > preempted


def test_disaggregated_answers_equal_the_mixed_agents(base, disaggregated):
    """Prompts prefilled on one agent and decoded on another (their states moved with their K/V)
    answer as the mixed agent does, whether they ask for speculation or not (a decode agent runs
    no mixed steps, so it verifies none), a prompt asked again too (the prefill agent computes a
    whole prompt in one call: it saves no snapshot, so it finds no hit)."""
    prompts = [PROMPT, "alpha beta gamma alpha beta gamma alpha beta", "zq8 #x! 4@m"]
    sent = metric(disaggregated, "llm_serving_kv_transfer_bytes_total")
    for prompt in prompts:
        want = complete(base, prompt, speculate=False, max_tokens=30)
        assert complete(disaggregated, prompt, speculate=False, max_tokens=30) == want
        assert complete(disaggregated, prompt, max_tokens=30) == want
    assert metric(disaggregated, "llm_serving_kv_transfer_bytes_total") > sent
