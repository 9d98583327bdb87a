"""Speculative decoding (runtime.speculation, n-gram prompt lookup) through the HTTP API on the tiny
model: every answer equals the same request's answer with speculation opted out (`speculate:
false`), whatever the proposals were; grammars, stop strings, min_tokens, logprobs and preemption
on a small KV pool stay correct; /metrics counts proposed and kept tokens. Hostile mixes: requests
with logprobs verified beside requests without them fail nothing, and a seeded sampled answer is
the same alone and under load."""

import json
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from agent_harness import LONG_ANSWERS_RUNTIME, free_ports, serving_stack, write_config
from attack_watch import under_attack
from browser import chromium_driver
from config.schema import PROJECT_ROOT
from waiting import wait_until

# Prompts that repeat themselves (what prompt lookup proposes from), and one that does not.
PROMPTS = [
    "one two three four five six, one two three four five six, one two three",
    "def add(a, b):\n    return a + b\n\ndef add(a, b):\n    return a",
    "The quick brown fox jumps over the lazy dog. The quick brown fox",
    "zq8 #x! 4@m",
]
# max_batch 8: proposals go on while the attacks below and their victim (5 sequences) decode;
# adaptive false: on the tiny model verifying costs more than it earns, and the cost-aware lengths
# would propose nothing once they learned it: these tests are of the verification
SPECULATION = {
    "method": "ngram",
    "num_tokens": 4,
    "ngram_min": 1,
    "ngram_max": 3,
    "max_batch": 8,
    "adaptive": False,
}


@pytest.fixture(scope="module")
def stack(tmp_path_factory, tiny_llama_dir):
    """Agent + server on the tiny model with n-gram speculation, and a KV pool of 24 blocks of 16
    (two sequences of 192 positions): 8 long requests at once preempt."""
    agent_port, http_port = free_ports(2)
    runtime = {**LONG_ANSWERS_RUNTIME, "max_seq_len": 192, "attend_buckets": [64, 192]}
    runtime |= {"num_blocks": 24, "block_size": 16, "speculation": SPECULATION}
    path = write_config(
        tmp_path_factory.mktemp("speculation"),
        tiny_llama_dir,
        [agent_port],
        runtime=runtime,
        server={"port": http_port},
        scheduler={"max_waiting_requests": 16},
    )
    with serving_stack(path) as (_agents, _server):
        yield f"http://127.0.0.1:{http_port}"


def generate(base: str, inputs: str, speculate: bool, **parameters) -> dict:
    parameters = {"max_new_tokens": 48, "ignore_eos": True, "speculate": speculate, **parameters}
    reply = httpx.post(
        f"{base}/models/tiny/generate", json={"inputs": inputs, "parameters": parameters}, timeout=120
    )
    assert reply.status_code == 200, reply.text
    return reply.json()


def counters(base: str) -> dict[str, float]:
    families = text_string_to_metric_families(httpx.get(f"{base}/metrics").text)
    return {s.name: s.value for f in families for s in f.samples if s.name.startswith("llm_serving_spec_")}


def test_greedy_answers_equal_the_answers_without_speculation_and_proposals_are_kept(stack):
    before = counters(stack)
    for prompt in PROMPTS:
        fast, plain = generate(stack, prompt, True), generate(stack, prompt, False)
        assert fast["generated_text"] == plain["generated_text"], prompt
    after = counters(stack)
    proposed = (
        after["llm_serving_spec_proposed_tokens_total"] - before["llm_serving_spec_proposed_tokens_total"]
    )
    kept = after["llm_serving_spec_accepted_tokens_total"] - before["llm_serving_spec_accepted_tokens_total"]
    steps = after["llm_serving_spec_steps_total"] - before["llm_serving_spec_steps_total"]
    assert 0 < kept <= proposed and 0 < steps <= proposed, (kept, proposed, steps)


def test_opting_out_proposes_nothing(stack):
    before = counters(stack)
    generate(stack, PROMPTS[0], False)
    assert counters(stack) == before


def test_stop_strings_min_tokens_and_logprobs_are_those_without_speculation(stack):
    """A stop string met inside a step's kept proposals ends the text where it would end; min_tokens
    holds the stop ids back for each verified position; each token keeps its own logprobs."""
    plain = generate(stack, PROMPTS[0], False)["generated_text"]
    stop = plain[20:23]
    for parameters in ({"stop": [stop]}, {"details": True, "top_n_tokens": 2}):
        fast, slow = (
            generate(stack, PROMPTS[0], True, **parameters),
            generate(stack, PROMPTS[0], False, **parameters),
        )
        assert fast["generated_text"] == slow["generated_text"], parameters
        if "details" in parameters:
            fast_tokens, slow_tokens = fast["details"]["tokens"], slow["details"]["tokens"]
            assert [t["id"] for t in fast_tokens] == [t["id"] for t in slow_tokens]
            assert [t["logprob"] for t in fast_tokens] == pytest.approx(
                [t["logprob"] for t in slow_tokens], abs=1e-3
            )
            assert [[t["id"] for t in top] for top in fast["details"]["top_tokens"]] == [
                [t["id"] for t in top] for top in slow["details"]["top_tokens"]
            ]
    assert stop not in generate(stack, PROMPTS[0], True, stop=[stop])["generated_text"]
    completions = [
        httpx.post(
            f"{stack}/v1/completions",
            json={"model": "tiny", "prompt": PROMPTS[1], "max_tokens": 40, "min_tokens": 30, "temperature": 0}
            | {"speculate": speculate},
            timeout=120,
        ).json()["choices"][0]
        for speculate in (True, False)
    ]
    assert completions[0] == completions[1]


def test_grammar_requests_beside_speculating_ones_follow_their_grammar(stack):
    """A sequence under a grammar proposes nothing (its mask holds for one token); it runs beside
    speculating sequences in the same steps and its answer is its answer alone."""
    grammar = {"type": "regex", "value": "[a-z]{3}-[0-9]{2}( [a-z]{3}-[0-9]{2})*"}
    with ThreadPoolExecutor(4) as pool:
        spec = [pool.submit(generate, stack, p, True) for p in PROMPTS[:3]]
        constrained = pool.submit(generate, stack, PROMPTS[0], True, grammar=grammar, max_new_tokens=30)
        answers = [f.result()["generated_text"] for f in spec]
        text = constrained.result()["generated_text"]
    assert re.fullmatch(grammar["value"], text), text
    assert text == generate(stack, PROMPTS[0], False, grammar=grammar, max_new_tokens=30)["generated_text"]
    assert answers == [generate(stack, p, False)["generated_text"] for p in PROMPTS[:3]]


def test_the_dashboard_shows_the_acceptance_rate(stack):
    from selenium.webdriver.support.ui import WebDriverWait

    driver = chromium_driver()
    try:
        driver.get(f"{stack}/dashboard")
        with ThreadPoolExecutor(1) as pool:
            load = pool.submit(lambda: [generate(stack, p, True, max_new_tokens=100) for p in PROMPTS[:2]])
            chart = lambda name: driver.find_element("id", "chart-" + name)  # noqa: E731
            WebDriverWait(driver, 60, 0.2).until(lambda d: float(chart("spec").get_attribute("data-max")) > 0)
            assert 0 < float(chart("spec").get_attribute("data-max")) <= 100
            assert float(chart("specstep").get_attribute("data-max")) > 0
            load.result()
        assert " / " in driver.find_element("id", "models").text
    finally:
        driver.quit()


def test_answers_under_preemption_equal_their_answers_alone(stack):
    """8 requests of ~160 positions on a pool of 24 blocks of 16: sequences are preempted and
    recomputed while others speculate; every answer is the one it gets alone without speculation."""
    prompts = [PROMPTS[i % 3] + f" {i}" for i in range(8)]
    with ThreadPoolExecutor(8) as pool:
        answers = list(
            pool.map(lambda p: generate(stack, p, True, max_new_tokens=80)["generated_text"], prompts)
        )
    metrics = httpx.get(f"{stack}/metrics").text
    preempted = re.search(r"^llm_serving_preemptions_total\{[^}]*\} (\S+)", metrics, re.M)
    assert preempted and float(preempted.group(1)) > 0, "nothing was preempted: the test tests nothing"
    alone = [generate(stack, p, False, max_new_tokens=80)["generated_text"] for p in prompts]
    assert answers == alone


# ------------------------------------------------------------------------------- hostile mixes

VICTIM = {"inputs": "The capital of France is", "parameters": {"max_new_tokens": 140, "ignore_eos": True}}


def victim_text(base: str) -> str:
    """A greedy stream's text (plain protocol); an error line fails it."""
    body = {**VICTIM, "parameters": {**VICTIM["parameters"], "return_protocol": "plain"}}
    text = []
    with httpx.stream("POST", f"{base}/models/tiny/generate_stream", json=body, timeout=120) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if line:
                event = json.loads(line.removeprefix("data:"))
                assert "error" not in event, event
                text.append(event["token"]["text"])
    return "".join(text)


def completion(base: str, prompt: str, **body) -> httpx.Response:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 48, "temperature": 0, **body}
    return httpx.post(f"{base}/v1/completions", json=body, timeout=120)


def batch_size(base: str) -> int:
    return json.loads(httpx.get(f"{base}/serving/get_bs", timeout=30).text.split("data:", 1)[1])["data"]


def test_requests_with_logprobs_verified_beside_others_fail_nothing(stack):
    """Two greedy answers that repeat their prompt keep several proposals a step while two requests
    with logprobs share those steps: the reply then listed no logprobs for the tokens of the slots
    that asked none, its list fell short of its tokens, and every sequence of the group got a 503
    (the victim's stream too). Now each request gets its answer, with a logprob per token."""
    expected = victim_text(stack)
    bodies = [
        {"prompt": PROMPTS[0]},
        {"prompt": PROMPTS[2]},
        {"prompt": PROMPTS[0], "logprobs": 1},
        {"prompt": PROMPTS[1], "logprobs": 1},
    ]
    before = counters(stack)
    with under_attack(stack, lambda: victim_text(stack), expected, name="speculation: logprobs mix"):
        with ThreadPoolExecutor(len(bodies)) as pool:
            replies = list(pool.map(lambda body: completion(stack, **body), bodies))
    assert [r.status_code for r in replies] == [200] * len(bodies), [r.text[:200] for r in replies]
    kept = counters(stack)["llm_serving_spec_accepted_tokens_total"]
    assert kept > before["llm_serving_spec_accepted_tokens_total"], "nothing kept: the test tests nothing"
    for reply in replies[2:]:
        choice = reply.json()["choices"][0]
        assert len(choice["logprobs"]["tokens"]) == reply.json()["usage"]["completion_tokens"]
        assert len(choice["logprobs"]["token_logprobs"]) == len(choice["logprobs"]["tokens"])
    plain = [completion(stack, **body, speculate=False).json()["choices"][0] for body in bodies]
    assert [r.json()["choices"][0]["text"] for r in replies] == [c["text"] for c in plain]


def test_a_seeded_sampled_answer_is_the_same_alone_and_under_load(stack):
    """Alone, a seeded sampled sequence verifies proposals on most steps; under load (a full KV
    pool, every logit row taken) it decodes one token a step. Its random draws were one stateful
    generator's, consumed differently by a verified step and a plain one, so the text depended on
    how busy the server was; now each position's draw is its own, whatever the step."""
    seeded = {"do_sample": True, "temperature": 1.0, "seed": 11, "max_new_tokens": 40}
    before = counters(stack)["llm_serving_spec_proposed_tokens_total"]
    alone = generate(stack, PROMPTS[0], True, **seeded)["generated_text"]
    assert counters(stack)["llm_serving_spec_proposed_tokens_total"] > before, "alone, nothing was proposed"
    load_prompts = [PROMPTS[i % 3] + f" {i}" for i in range(7)]
    with ThreadPoolExecutor(len(load_prompts)) as pool:
        load = [pool.submit(generate, stack, p, True, max_new_tokens=120) for p in load_prompts]
        wait_until(lambda: batch_size(stack) >= 4, 60, "4 of the load's requests running")
        busy = generate(stack, PROMPTS[0], True, **seeded)["generated_text"]
        for answer in load:
            answer.result()
    assert busy == alone


# ------------------------------------------------------------------------------------ draft model


@pytest.fixture(scope="module")
def draft_stack(tmp_path_factory, tiny_llama_dir):
    """Agent + server on the tiny model with the model itself as its draft model."""
    agent_port, http_port = free_ports(2)
    runtime = {**LONG_ANSWERS_RUNTIME, "max_seq_len": 192, "attend_buckets": [64, 192]}
    runtime["speculation"] = {"method": "draft", "draft_model": str(tiny_llama_dir), "num_tokens": 3}
    path = write_config(
        tmp_path_factory.mktemp("draft"),
        tiny_llama_dir,
        [agent_port],
        runtime=runtime,
        server={"port": http_port},
    )
    with serving_stack(path) as (agents, _server):
        yield f"http://127.0.0.1:{http_port}", agents


def test_a_draft_model_changes_no_answer_and_itself_as_draft_has_every_proposal_kept(draft_stack):
    base, agents = draft_stack
    log = (agents.config_path.parent / "logs" / "agent_0.log").read_text()
    assert "draft model tiny-llama" in log and "compile cache off" in log
    before = counters(base)
    with ThreadPoolExecutor(3) as pool:  # three sequences draft in one batch
        fast = list(pool.map(lambda p: generate(base, p, True)["generated_text"], PROMPTS[:3]))
    after = counters(base)
    assert fast == [generate(base, p, False)["generated_text"] for p in PROMPTS[:3]]
    proposed = (
        after["llm_serving_spec_proposed_tokens_total"] - before["llm_serving_spec_proposed_tokens_total"]
    )
    kept = after["llm_serving_spec_accepted_tokens_total"] - before["llm_serving_spec_accepted_tokens_total"]
    assert proposed > 0 and kept == proposed


def test_a_draft_model_of_another_vocabulary_stops_the_agents_naming_it(tmp_path, tiny_llama_dir):
    from tiny_models import write_tiny_checkpoint, write_tokenizer

    other = write_tiny_checkpoint(tmp_path / "other", seed=3)
    write_tokenizer(other, vocab_size=300)
    runtime = {"speculation": {"method": "draft", "draft_model": str(other)}}
    path = write_config(tmp_path, tiny_llama_dir, free_ports(1), runtime=runtime)
    done = subprocess.run(
        [sys.executable, "start_agent.py", "--config", str(path)],
        cwd=PROJECT_ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    output = done.stdout + done.stderr + (tmp_path / "logs" / "agent_0.log").read_text()
    assert (
        done.returncode != 0 and "its vocabulary is not the model's (300 tokens, the model's 400)" in output
    )
