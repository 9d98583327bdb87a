"""Tensor parallelism with real processes: one group of two agents runs the default model split
across them (MindSpore's dynamic cluster, AllReduce inside the graphs) and answers greedily with
exactly the tokens of one whole model."""

import re

import httpx
import pytest
from conftest import DEFAULT_RUNTIME
from test_runner import generate_alone

from agent.model.tokenizer import load_tokenizer
from agent_harness import free_ports, serving_stack, wait_gone, write_config
from config import load_config
from config.schema import PROJECT_ROOT
from http_client import post

QUESTIONS = [
    "What is the capital of France?",
    "Say hello in three languages, please.",
    "Why is the sky blue?",
]
NEW_TOKENS = 32

pytestmark = pytest.mark.default_model


@pytest.fixture(scope="module")
def tensor_parallel(tmp_path_factory, default_model_path):
    ports = free_ports(4)
    runtime = DEFAULT_RUNTIME.model_dump(mode="json")
    path = write_config(
        tmp_path_factory.mktemp("tensor-parallel"),
        default_model_path,
        ports[:2],
        runtime=runtime,
        model={"name": "smollm2"},
        agents={"ports": ports[:2], "groups": [{"ports": ports[:2], "cluster_port": ports[2]}]},
        server={"port": ports[3]},
    )
    with serving_stack(path) as (agents, server):
        yield {"base": f"http://127.0.0.1:{ports[3]}", "agents": agents, "logs": path.parent / "logs"}


def test_two_ranks_answer_with_the_whole_models_greedy_tokens(
    tensor_parallel, default_runner, default_model_path, release_all
):
    release_all(default_runner)
    tokenizer = load_tokenizer(default_model_path)
    for question in QUESTIONS:
        prompt = tokenizer.encode_chat([{"role": "user", "content": question}])
        tokens = generate_alone(default_runner, prompt, NEW_TOKENS)
        ends = [i for i, t in enumerate(tokens) if t in tokenizer.eos_ids]
        # The server never sends half a UTF-8 character: a cut-off emoji at the end is dropped.
        want = tokenizer.decode(tokens[: ends[0]] if ends else tokens).rstrip("\ufffd")
        response = post(
            f"{tensor_parallel['base']}/models/smollm2/generate",
            {"inputs": question, "parameters": {"max_new_tokens": NEW_TOKENS, "chat_template": True}},
        )
        assert response.status_code == 200, response.text
        assert response.json()["generated_text"] == want
    assert (
        "Paris"
        in post(
            f"{tensor_parallel['base']}/models/smollm2/generate",
            {"inputs": QUESTIONS[0], "parameters": {"max_new_tokens": 20, "chat_template": True}},
        ).json()["generated_text"]
    )

    # Each rank holds its share: 3 KV heads are 2 + 1, the FFN columns half each.
    logs = tensor_parallel["logs"]
    assert "rank 0 of 2: KV heads 0..1, FFN columns (0, 768)" in (logs / "agent_0.log").read_text()
    assert "rank 1 of 2: KV heads 2..2, FFN columns (768, 1536)" in (logs / "agent_1.log").read_text()
    group = httpx.get(f"{tensor_parallel['base']}/info").json()["groups"]
    assert len(group) == 1 and len(group[0]["agents"]) == 2


def test_sigterm_stops_both_ranks_and_the_cluster_scheduler(tensor_parallel):
    """Last in this module."""
    agents = tensor_parallel["agents"]
    pids = agents.descendant_pids()
    assert len(pids) >= 3  # two agents and the cluster scheduler (and the resource tracker)
    agents.process.terminate()
    assert agents.process.wait(60) == 0
    assert wait_gone(pids, 30) == []
    assert re.search(r"all agents stopped", agents.output())


def test_shipped_tensor_parallel_config_is_one_group_of_two_agents():
    config = load_config(PROJECT_ROOT / "config" / "tensor_parallel.yaml")
    default = load_config(PROJECT_ROOT / "config" / "default.yaml")
    (group,) = config.agents.groups
    assert group.ports == [9820, 9821] and group.cluster_port and config.model == default.model
