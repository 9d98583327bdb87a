"""Two real servers on one agent (a rolling restart, or a second server started by mistake): the
newer one wins, the displaced one stops using the agent, says why, and never takes it back."""

import time

import httpx
import pytest

from agent_harness import LauncherProcess, free_ports, serving_stack, write_config
from http_client import post
from scheduler.group_links import RECOVERY_INTERVAL_S


def body(inputs: str) -> dict:
    return {"inputs": inputs, "parameters": {"max_new_tokens": 16, "ignore_eos": True}}


@pytest.fixture(scope="module")
def two_servers(tmp_path_factory, tiny_llama_dir):
    agent_port, old_port, new_port = free_ports(3)
    old_config, new_config = (
        write_config(tmp_path_factory.mktemp(name), tiny_llama_dir, [agent_port], server={"port": port})
        for name, port in (("old", old_port), ("new", new_port))
    )
    with serving_stack(old_config) as (_agents, old_server):
        old = f"http://127.0.0.1:{old_port}"
        want = post(f"{old}/models/tiny/generate", body("takeover")).json()["generated_text"]
        new_server = LauncherProcess(new_config, script="start_server.py")
        try:
            new_server.wait_for("Application startup complete", 120)
            yield old, f"http://127.0.0.1:{new_port}", want, old_server
        finally:
            new_server.close()


def test_the_newer_server_wins_and_the_displaced_one_leaves_the_agent_alone(two_servers):
    old, new, want, old_server = two_servers
    displaced = post(f"{old}/models/tiny/generate", body("takeover"))
    assert displaced.status_code == 503 and "another server took" in displaced.json()["error"]
    ready = httpx.get(f"{old}/ready", timeout=30)
    assert ready.status_code == 503 and "another server took these agents over" in ready.json()["error"]
    refused = post(f"{old}/models/tiny/generate", body("takeover"))
    assert refused.status_code == 503 and "another server took these agents over" in refused.json()["error"]
    # Long past the displaced server's recovery interval, the new one still owns the agent.
    deadline = time.monotonic() + 5 * RECOVERY_INTERVAL_S + 3
    while time.monotonic() < deadline:
        answer = post(f"{new}/models/tiny/generate", body("takeover"))
        assert answer.status_code == 200 and answer.json()["generated_text"] == want, answer.text
        time.sleep(0.2)
    assert httpx.get(f"{new}/ready", timeout=30).status_code == 200
    assert "is back: serving on it again" not in old_server.output()
