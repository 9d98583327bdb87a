"""Fair share keyed only on what the server checked, against a real agent and `start_server.py` on
the tiny model with admin keys only (inference open, as the explicit-model-control start-up check
leads operators to configure): a client that makes up a new key for each request is still one
client (its address), so `scheduler.max_running_per_client` holds it to one running answer, while
another client (another loopback address) runs beside it with its exact answer."""

import json
import secrets
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from agent_harness import LONG_ANSWERS_RUNTIME, free_ports, serving_stack, write_config
from attack_watch import under_attack

ATTACKERS = 4
BODY = {
    "inputs": "The capital of France is",
    "parameters": {"max_new_tokens": 200, "ignore_eos": True, "return_protocol": "plain"},
}


@pytest.fixture(scope="module")
def stack(tmp_path_factory, tiny_llama_dir):
    agent_port, http_port = free_ports(2)
    path = write_config(
        tmp_path_factory.mktemp("identity"),
        tiny_llama_dir,
        [agent_port],
        runtime=LONG_ANSWERS_RUNTIME,
        server={"port": http_port, "admin_api_keys": ["admin-key"]},
        scheduler={"max_running_per_client": 1},
    )
    with serving_stack(path):
        yield f"http://127.0.0.1:{http_port}"


def stream_text(base: str, source: str, headers: dict | None = None) -> str:
    """A plain-protocol stream's text, sent from loopback address `source`."""
    transport = httpx.HTTPTransport(local_address=source)
    with httpx.Client(transport=transport, timeout=120) as client:
        url = f"{base}/models/tiny/generate_stream"
        with client.stream("POST", url, json=BODY, headers=headers) as reply:
            assert reply.status_code == 200, reply.read()
            lines = [json.loads(line.removeprefix("data:")) for line in reply.iter_lines() if line]
    assert all("error" not in line for line in lines), lines
    return "".join(line["token"]["text"] for line in lines)


def batch_size(base: str) -> int:
    text = httpx.get(f"{base}/serving/get_bs", timeout=30).text
    return json.loads(text.split("data:", 1)[1])["data"]


def test_made_up_keys_do_not_make_new_clients(stack):
    base = stack
    expected = stream_text(base, "127.0.0.2")

    def attacker() -> str:  # a fresh key nobody checks, each request
        return stream_text(base, "127.0.0.1", {"Authorization": f"Bearer {secrets.token_hex(8)}"})

    most_running = 0
    with under_attack(base, lambda: stream_text(base, "127.0.0.2"), expected, "made-up keys"):
        with ThreadPoolExecutor(ATTACKERS) as pool:
            answers = [pool.submit(attacker) for _ in range(ATTACKERS)]
            while not all(a.done() for a in answers):
                most_running = max(most_running, batch_size(base))
                time.sleep(0.02)  # the batch size sampled every 20 ms while the attack runs
            texts = [a.result() for a in answers]
    # The attacker's four answers ran one at a time (one client, capped at one), beside the victim;
    # on main each made-up key was a client of its own and all five ran at once.
    assert 1 <= most_running <= 2, most_running
    assert all(text == expected for text in texts)
