"""N-gram speculation is on by default: a stack configured with no `runtime.speculation` proposes
tokens (/metrics counts them), and its greedy answers equal those of a stack with `method: none`,
for prompts that copy themselves and one that does not.

Which steps propose is the cost-aware rule's choice, from step times the scheduler measures
(scheduler/speculation/verify_costs.py): so how many proposed tokens are kept depends on the machine's load,
and is not asserted here. That kept tokens leave greedy answers unchanged is asserted where the
proposal length is fixed (test_speculation.py, `adaptive: false`)."""

from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from agent_harness import LONG_ANSWERS_RUNTIME, free_ports, serving_stack, write_config

PROMPTS = [
    "one two three four five six, one two three four five six, one two three",
    "Copy this line exactly: the red fox ran home. Copy this line exactly: the red fox ran home.",
    "def add(a, b):\n    return a + b\n\ndef add(a, b):\n    return a",
    "zq8 #x! 4@m",
]


@pytest.fixture(scope="module")
def stacks(tmp_path_factory, tiny_llama_dir):
    """Two stacks on the tiny model: the default speculation, and speculation off."""
    urls = {}
    with ExitStack() as running:
        for name, runtime in (("default", {}), ("none", {"speculation": {"method": "none"}})):
            agent_port, http_port = free_ports(2)
            path = write_config(
                tmp_path_factory.mktemp(f"speculation_{name}"),
                tiny_llama_dir,
                [agent_port],
                runtime={**LONG_ANSWERS_RUNTIME, "max_seq_len": 192, "attend_buckets": [64, 192], **runtime},
                server={"port": http_port},
            )
            running.enter_context(serving_stack(path))
            urls[name] = f"http://127.0.0.1:{http_port}"
        yield urls


def generate(base: str, inputs: str) -> str:
    parameters = {"max_new_tokens": 48, "ignore_eos": True}
    reply = httpx.post(
        f"{base}/models/tiny/generate", json={"inputs": inputs, "parameters": parameters}, timeout=120
    )
    assert reply.status_code == 200, reply.text
    return reply.json()["generated_text"]


def proposed_and_kept(base: str) -> tuple[float, float]:
    families = text_string_to_metric_families(httpx.get(f"{base}/metrics").text)
    values = {s.name: s.value for f in families for s in f.samples}
    return values["llm_serving_spec_proposed_tokens_total"], values["llm_serving_spec_accepted_tokens_total"]


def test_default_greedy_answers_equal_those_without_speculation_and_proposals_are_made(stacks):
    before = proposed_and_kept(stacks["default"])
    fast = [generate(stacks["default"], p) for p in PROMPTS]
    plain = [generate(stacks["none"], p) for p in PROMPTS]
    assert fast == plain
    proposed, kept = (after - prior for after, prior in zip(proposed_and_kept(stacks["default"]), before))
    assert proposed > 0 and 0 <= kept <= proposed, (kept, proposed)
    assert proposed_and_kept(stacks["none"]) == (0, 0)


def test_default_answers_in_one_batch_equal_those_without_speculation(stacks):
    """The prompts at once: their sequences' proposal lengths are chosen together, per step."""
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        fast = list(pool.map(lambda p: generate(stacks["default"], p), PROMPTS))
    assert fast == [generate(stacks["none"], p) for p in PROMPTS]
