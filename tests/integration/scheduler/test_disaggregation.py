"""PD disaggregation with real processes: one prefill agent and two decode agents behind one server
(config groups with roles), against one mixed agent of the same tiny model."""

import asyncio
import json
import os
import re
import shutil
import signal
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from agent.contract.transport import ClientKeys
from agent.model.formats import load_checkpoint
from agent_harness import LauncherProcess, curve_keys, free_ports, serving_stack, write_config
from config import load_config
from config.schema import PROJECT_ROOT
from http_client import post
from scheduler.agent_client import AgentClient, AgentError
from waiting import wait_until

# Several lengths: 16, 64 and 64+ prompt buckets of the tiny runtime (prompts up to 64 tokens).
TEXTS = [
    "Hi",
    "The quick brown fox",
    "你好，世界！ " * 3,
    "emoji 😀 🎉 " * 4,
    "Numbers 0123456789 " * 5,
    "The capital of France is Paris. " * 4,
    "北京是中国的首都",
    "café naïve résumé " * 6,
]
GROUPS = [
    {"role": "prefill", "ports": None, "num_slots": 2},
    {"role": "decode", "ports": None},
    {"role": "decode", "ports": None},
]
TRANSFER_TIMEOUT_S = 3


def generate(base: str, text: str, **parameters):
    return post(
        f"{base}/models/tiny/generate",
        {"inputs": text, "parameters": {"max_new_tokens": 20, "ignore_eos": True, **parameters}},
    )


def answers(base: str, texts: list[str], concurrent: bool) -> list[str]:
    def one(text):
        response = generate(base, text)
        assert response.status_code == 200, response.text
        return response.json()["generated_text"]

    if not concurrent:
        return [one(t) for t in texts]
    with ThreadPoolExecutor(len(texts)) as pool:
        return list(pool.map(one, texts))


@pytest.fixture(scope="module")
def mixed_answers(tmp_path_factory, tiny_llama_dir):
    ports = free_ports(2)
    path = write_config(
        tmp_path_factory.mktemp("mixed"), tiny_llama_dir, ports[:1], server={"port": ports[1]}
    )
    with serving_stack(path):
        yield answers(f"http://127.0.0.1:{ports[1]}", TEXTS, concurrent=False)


@pytest.fixture(scope="module")
def disaggregated(tmp_path_factory, tiny_llama_dir):
    """With CURVE on, as a multi-host set-up has it: the KV goes agent to agent under the prefill
    agent's own key."""
    ports = free_ports(4)
    groups = [{**g, "ports": [p]} for g, p in zip(GROUPS, ports)]
    curve = curve_keys(len(GROUPS))
    path = write_config(
        tmp_path_factory.mktemp("disaggregated"),
        tiny_llama_dir,
        ports[:3],
        agents={"groups": groups, "kv_transfer_timeout_s": TRANSFER_TIMEOUT_S, "curve": curve},
        server={"port": ports[3]},
    )
    with serving_stack(path) as (agents, server):
        yield {
            "base": f"http://127.0.0.1:{ports[3]}",
            "agents": agents,
            "server": server,
            "ports": ports[:3],
            "curve": load_config(path).agents.curve,
            "logs": path.parent / "logs",
        }


def metric(base: str, name: str) -> float:
    match = re.search(rf'^{name}\{{model="tiny"\}} (\S+)$', httpx.get(f"{base}/metrics").text, re.M)
    return float(match.group(1))


def test_answers_equal_the_mixed_agent_under_8_streams(disaggregated, mixed_answers, tiny_llama_dir):
    base = disaggregated["base"]
    before_bytes = metric(base, "llm_serving_kv_transfer_bytes_total")
    before_tokens = metric(base, "llm_serving_prompt_tokens_total")
    assert answers(base, TEXTS, concurrent=True) == mixed_answers

    # Every prompt's K/V went over the wire, exactly its size: 2 x layers x KV heads x head_dim
    # floats a token.
    spec = load_checkpoint(tiny_llama_dir).spec
    per_token = 2 * spec.num_layers * spec.num_kv_heads * spec.head_dim * 4
    prompt_tokens = metric(base, "llm_serving_prompt_tokens_total") - before_tokens
    assert metric(base, "llm_serving_kv_transfer_bytes_total") - before_bytes == prompt_tokens * per_token
    log = (disaggregated["logs"] / "agent_0.log").read_text()
    assert re.search(r"KV of \d+ tokens \(\d+ bytes\) sent to tcp://127\.0\.0\.1:\d+ slot \d+", log)

    info = httpx.get(f"{base}/info").json()
    assert [g["role"] for g in info["groups"]] == ["prefill", "decode", "decode"]
    assert info["slots"] == 8  # the decode groups' slots: those are where requests live


def test_seeded_sampling_continues_on_the_decode_agent(disaggregated, tmp_path_factory):
    """The sampler's RNG state moves with the KV: same seed, same text, wherever it decodes."""
    base = disaggregated["base"]
    params = {"do_sample": True, "top_k": 20, "temperature": 0.8, "seed": 5}
    first = generate(base, "The quick brown fox", **params).json()["generated_text"]
    assert generate(base, "The quick brown fox", **params).json()["generated_text"] == first
    assert first != generate(base, "The quick brown fox", **{**params, "seed": 6}).json()["generated_text"]


def test_logprobs_come_from_both_agents(disaggregated):
    """The first token is sampled on the prefill agent, the rest on the decode agent: every token
    has its logprob, and (greedy) each is its row's most likely token."""
    reply = generate(disaggregated["base"], "The quick brown fox", details=True, top_n_tokens=2).json()
    details = reply["details"]
    assert len(details["tokens"]) == 20 == details["generated_tokens"]
    for token, top in zip(details["tokens"], details["top_tokens"]):
        assert token["logprob"] <= 0 and top[0]["id"] == token["id"] and top[0]["logprob"] == token["logprob"]
    assert "".join(t["text"] for t in details["tokens"]) == reply["generated_text"]


def test_a_grammar_holds_on_both_agents(disaggregated):
    """The first token's mask goes to the prefill agent, the rest to the decode agent."""
    grammar = {"type": "regex", "value": "[a-z]{5}-[0-9]{10}"}
    reply = generate(disaggregated["base"], "The quick brown fox", ignore_eos=False, grammar=grammar)
    assert re.fullmatch(grammar["value"], reply.json()["generated_text"]), reply.text


def test_a_prefill_agents_key_may_only_send_kv(disaggregated):
    """The prefill agent holds its own keypair, not the server's: a decode agent takes only
    kv_receive from it (not info, reset, decode or release), and the prefill agent does not admit
    a decode agent's key at all."""
    curve, ports = disaggregated["curve"], disaggregated["ports"]
    prefill_keypair = (curve.agents[0].public_key, curve.agents[0].secret_key)

    async def call(rank: int, keypair: tuple[str, str], op: str, **fields) -> dict:
        keys = ClientKeys(*keypair, agent_public_key=curve.agents[rank].public_key)
        client = AgentClient(f"tcp://127.0.0.1:{ports[rank]}", timeout_s=3, keys=keys)
        try:
            header, _ = await client.call(op, **fields)
            return header
        except AgentError as exc:
            return {"error": str(exc)}
        finally:
            client.close()

    for op, fields in (("info", {}), ("reset", {"session": 1}), ("release", {"slot": 0, "session": 1})):
        answer = asyncio.run(call(1, prefill_keypair, op, **fields))
        assert "another agent may only send kv_receive" in answer["error"], (op, answer)
    answer = asyncio.run(call(1, prefill_keypair, "kv_receive", slot=0, ticket=1, session=1))
    # past the key check, refused for its (made-up) session: kind stale_session
    assert "took this agent over" in answer["error"], answer
    decode_keypair = (curve.agents[1].public_key, curve.agents[1].secret_key)
    assert "refused the connection" in asyncio.run(call(0, decode_keypair, "info"))["error"]
    # the server's keys still work, and the stack still answers
    assert asyncio.run(call(1, curve.server_keypair(), "info"))["role"] == "decode"
    assert generate(disaggregated["base"], "Hi").status_code == 200


def group_stats(base: str) -> list[dict]:
    return httpx.get(f"{base}/info").json()["groups"]


def settled(base: str) -> bool:
    """No request runs and every agent has answered the release of each slot freed."""
    return all(g["running"] == 0 and g["releases_pending"] == 0 for g in group_stats(base))


def agent_pid(agents, rank: int) -> int:
    lines = [line for line in agents.lines if f"agent rank {rank} starting (pid" in line]
    return int(re.search(r"pid (\d+)", lines[-1]).group(1))


def test_decode_agent_killed_during_a_transfer_fails_that_request_only(disaggregated, mixed_answers):
    """The first decode agent is stopped (it takes no KV), a request's transfer to it is in flight,
    then it is killed: that request fails with the transfer error in bounded time, the other
    decode group serves the next requests with unchanged answers."""
    base, agents = disaggregated["base"], disaggregated["agents"]
    pid = agent_pid(agents, 1)
    # Stopping the agent while it owes an answer to a release (an earlier answer's slot) would hold
    # that release instead of the transfer; with every slot free the request goes to the first
    # decode group, the stopped one.
    wait_until(lambda: settled(base), 10, "no request running and no release pending", poll_s=0.01)
    os.kill(pid, signal.SIGSTOP)
    try:
        with ThreadPoolExecutor(1) as pool:
            doomed = pool.submit(generate, base, TEXTS[1])
            # placed on the stopped group: its KV is on its way there, and the ack never comes
            wait_until(
                lambda: group_stats(base)[1]["running"] == 1, 30, "the request placed on the stopped group"
            )
            os.kill(pid, signal.SIGKILL)
            response = doomed.result(timeout=60)
    finally:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert response.status_code == 503, response.text
    # ended by the transfer timeout (not a hang, nor another failure)
    error = f"did not acknowledge the KV within {TRANSFER_TIMEOUT_S}s"
    assert error in response.json()["error"], response.json()

    assert answers(base, TEXTS[:4], concurrent=True) == mixed_answers[:4]
    groups = httpx.get(f"{base}/info").json()["groups"]
    assert groups[2]["slots"] == 4  # the other decode group kept serving


def test_shipped_disaggregated_config_is_a_prefill_and_a_decode_agent_of_the_default_model():
    config = load_config(PROJECT_ROOT / "config" / "disaggregated.yaml")
    default = load_config(PROJECT_ROOT / "config" / "default.yaml")
    assert config.agents.roles == ["prefill", "decode"] and config.model == default.model
    assert config.agents.ports == [9820, 9821]


class TwoHosts:
    """Two network namespaces joined by a veth pair: two "hosts" with addresses of their own."""

    def __init__(self):
        tag = os.getpid() % 10000
        self.names = [f"llmsA{tag}", f"llmsB{tag}"]
        self.addresses = [f"10.231.{tag % 250}.1", f"10.231.{tag % 250}.2"]
        veth = [f"llvA{tag}", f"llvB{tag}"]
        run = [
            ["ip", "netns", "add", self.names[0]],
            ["ip", "netns", "add", self.names[1]],
            ["ip", "link", "add", veth[0], "type", "veth", "peer", "name", veth[1]],
        ]
        for name, dev, address in zip(self.names, veth, self.addresses):
            run += [
                ["ip", "link", "set", dev, "netns", name],
                ["ip", "-n", name, "addr", "add", f"{address}/24", "dev", dev],
                ["ip", "-n", name, "link", "set", dev, "up"],
                ["ip", "-n", name, "link", "set", "lo", "up"],
            ]
        for command in run:
            done = subprocess.run(command, capture_output=True, text=True)
            if done.returncode != 0:
                self.close()
                raise OSError(f"{' '.join(command)}: {done.stderr.strip() or done.returncode}")

    def prefix(self, host: int) -> tuple:
        return ("ip", "netns", "exec", self.names[host])

    def close(self) -> None:
        for name in self.names:  # deleting a namespace deletes its end of the veth pair too
            subprocess.run(["ip", "netns", "del", name], capture_output=True)


def test_prefill_and_decode_agents_on_two_hosts(tmp_path, tiny_llama_dir, mixed_answers):
    """The prefill agent and the server on host A, the decode agent on host B (network namespaces):
    the K/V cross the veth link, CURVE-encrypted, and the answers are the mixed agent's."""
    if shutil.which("ip") is None:
        pytest.skip("no `ip` command (iproute2) to create network namespaces")
    try:
        hosts = TwoHosts()
    except OSError as exc:
        pytest.skip(f"cannot create network namespaces here (needs root and iproute2): {exc}")
    curve = curve_keys(2)
    ports = free_ports(3)
    groups = [
        {"role": "prefill", "ports": [ports[0]], "host": hosts.addresses[0]},
        {"role": "decode", "ports": [ports[1]], "host": hosts.addresses[1]},
    ]
    path = write_config(
        tmp_path,
        tiny_llama_dir,
        ports[:2],
        agents={"groups": groups, "curve": curve},
        server={"port": ports[2]},
    )
    launchers = []
    try:
        for host in (0, 1):
            launchers.append(LauncherProcess(path, args=("--groups", str(host)), prefix=hosts.prefix(host)))
        for launcher in launchers:
            launcher.wait_for("all agents started", 240)
        launchers.append(LauncherProcess(path, script="start_server.py", prefix=hosts.prefix(0)))
        launchers[-1].wait_for("Application startup complete", 120)
        client = (
            f"import httpx, json, sys; r = httpx.post('http://127.0.0.1:{ports[2]}/models/tiny/generate', "
            f"json={{'inputs': sys.argv[1], 'parameters': {{'max_new_tokens': 20, 'ignore_eos': True}}}}, "
            f"timeout=60); print(json.dumps([r.status_code, r.json()]))"
        )
        for text, want in zip(TEXTS[:3], mixed_answers):
            done = subprocess.run(
                [*hosts.prefix(0), sys.executable, "-c", client, text],
                capture_output=True,
                text=True,
                timeout=90,
            )
            assert json.loads(done.stdout) == [200, {"generated_text": want}], done.stderr
        log = (tmp_path / "logs" / "agent_0.log").read_text()
        assert f"sent to tcp://{hosts.addresses[1]}:{ports[1]}" in log
    finally:
        for launcher in reversed(launchers):
            launcher.close()
        hosts.close()
