"""Replicas: two mixed agents (groups) behind one server, as config/replicas.yaml runs them."""

import re
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from agent_harness import free_ports, serving_stack, write_config
from config import load_config
from config.schema import PROJECT_ROOT
from http_client import one_event, post

TEXTS = [
    "The quick brown fox",
    "你好，世界！",
    "emoji 😀 🎉",
    "Numbers 0123456789",
    "The capital of",
    "café naïve résumé",
    "symbols !?#%&*()",
    "北京是中国的首都",
]


@pytest.fixture(scope="module")
def replicas(tmp_path_factory, tiny_llama_dir):
    ports = free_ports(3)
    path = write_config(
        tmp_path_factory.mktemp("replicas"), tiny_llama_dir, ports[:2], server={"port": ports[2]}
    )
    with serving_stack(path):
        yield f"http://127.0.0.1:{ports[2]}", ports[:2]


def generate(base: str, text: str) -> str:
    response = post(
        f"{base}/models/tiny/generate",
        {"inputs": text, "parameters": {"max_new_tokens": 24, "ignore_eos": True}},
    )
    assert response.status_code == 200, response.text
    return response.json()["generated_text"]


def preemptions(base: str) -> float:
    """Sequences recomputed because a decode needed a block (llm_serving_preemptions_total)."""
    text = httpx.get(f"{base}/metrics").text
    return float(re.search(r'llm_serving_preemptions_total\{model="tiny"\} (\S+)', text).group(1))


def prefill_counts(base: str, ports: list[int]) -> list[float]:
    """Per agent, its calls that computed prompts: prefills, and mixed steps (a decode and chunks)."""
    text = httpx.get(f"{base}/metrics").text
    counts = []
    for port in ports:
        matches = re.findall(
            rf'llm_serving_agent_step_seconds_count\{{agent="tcp://127\.0\.0\.1:{port}",'
            rf'model="tiny",op="(?:prefill|mixed)"\}} (\S+)',
            text,
        )
        counts.append(sum(float(m) for m in matches))
    return counts


def test_both_replicas_serve_under_load_with_unchanged_answers(replicas):
    base, ports = replicas
    alone = [generate(base, t) for t in TEXTS]
    before, preempted = prefill_counts(base, ports), preemptions(base)
    with ThreadPoolExecutor(len(TEXTS)) as pool:  # 8 requests at once on 2 x 4 slots
        together = list(pool.map(lambda t: generate(base, t), TEXTS))
    assert together == alone
    after = prefill_counts(base, ports)
    used = [a - b for a, b in zip(after, before)]
    # spread by free slots (a call may compute chunks of several prompts, a prompt may take several
    # calls as the step costs allow); no prompt was computed again
    assert min(used) >= 2 and preemptions(base) == preempted == 0, used

    info = httpx.get(f"{base}/info").json()
    assert [g["group"] for g in info["groups"]] == [0, 1] and info["slots"] == 8
    assert all(g["slots"] == 4 and g["role"] == "mixed" for g in info["groups"])
    assert one_event(f"{base}/serving/get_bs?group=0") == one_event(f"{base}/serving/get_bs?group=1") == 0
    metrics = httpx.get(f"{base}/metrics").text
    assert 'llm_serving_group_slots{group="1",model="tiny"} 4.0' in metrics
    assert 'llm_serving_group_running_sequences{group="0",model="tiny"} 0.0' in metrics


def test_unknown_group_is_a_clear_400(replicas):
    base, _ = replicas
    response = httpx.get(f"{base}/serving/get_bs?group=2")
    assert response.status_code == 400
    assert response.json() == {"error": "group 2 does not exist (groups: 0..1)"}


def test_shipped_replicas_config_is_two_mixed_agents_of_the_default_model():
    config = load_config(PROJECT_ROOT / "config" / "replicas.yaml")
    default = load_config(PROJECT_ROOT / "config" / "default.yaml")
    assert config.agents.ports == [9820, 9821] and config.model == default.model
    assert config.runtime.num_slots * 2 == default.runtime.num_slots
