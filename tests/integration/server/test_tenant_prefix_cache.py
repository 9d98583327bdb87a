"""Tenants sharing a server with keys on (server.prefix_cache_per_key, the default): a key's prompt
blocks are hit by that key's later requests only, so another key cannot learn from its time to
first token whether a prompt was sent (the side channel /metrics is kept from it to hide), against
a real agent and `start_server.py` on the tiny model; the hits are read from /metrics with the
admin key."""

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from agent_harness import free_ports, serving_stack, write_config

KEY_A, KEY_B, ADMIN = "tenant-a-key", "tenant-b-key", "admin-key"
PROMPT = "Tenants keep their cached prompt blocks to themselves, whatever they ask. " * 4


@pytest.fixture(scope="module")
def base(tmp_path_factory, tiny_llama_dir):
    agent_port, http_port = free_ports(2)
    path = write_config(
        tmp_path_factory.mktemp("tenants"),
        tiny_llama_dir,
        [agent_port],
        runtime={"max_seq_len": 256, "prefill_buckets": [16, 256], "attend_buckets": [64, 256]},
        server={"port": http_port, "api_keys": [KEY_A, KEY_B], "admin_api_keys": [ADMIN]},
    )
    with serving_stack(path):
        yield f"http://127.0.0.1:{http_port}"


def prefix_hits(base: str) -> float:
    text = httpx.get(f"{base}/metrics", headers={"x-api-key": ADMIN}, timeout=30).text
    return sum(
        s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == "llm_serving_prefix_cache_hits_total"
    )


def hit_tokens(base: str, key: str, **extra) -> float:
    """The prompt tokens a completion of PROMPT by `key` found in the prefix cache."""
    before = prefix_hits(base)
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 1, **extra}
    reply = httpx.post(
        f"{base}/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"}, timeout=60
    )
    assert reply.status_code == 200, reply.text
    return prefix_hits(base) - before


def test_a_keys_prompt_blocks_are_its_own(base):
    assert hit_tokens(base, KEY_A) == 0  # the first time
    assert hit_tokens(base, KEY_B) == 0  # another key: no hit on A's blocks
    assert hit_tokens(base, KEY_A) > 0  # A again: its own blocks
    assert hit_tokens(base, KEY_B) > 0  # and B's own, from its first request
    assert hit_tokens(base, KEY_B, cache_salt="b-private") == 0  # a request's salt adds to the key's
