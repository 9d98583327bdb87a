"""Prefix routing's keys (tools/ray_serve/prefix.py): which text a request's prompt starts with, and
the chained hashes of its first blocks; and the shipped Ray config."""

import json

from config import load_config
from config.schema import PROJECT_ROOT
from tools.ray_serve.prefix import prefix_hashes, prompt_text


def body(value: dict) -> bytes:
    return json.dumps(value).encode()


def test_the_prompt_text_of_each_api():
    assert prompt_text("/models/m/generate", body({"inputs": "hello"})) == "hello"
    assert prompt_text("/v1/completions", body({"prompt": "hello"})) == "hello"
    assert prompt_text("/v1/completions", body({"prompt": ["first", "second"]})) == "first"
    chat = {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]}
    assert prompt_text("/v1/chat/completions", body(chat)) == "system:be brief\nuser:hi"
    parts = {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"text": "b"}]}]}
    assert prompt_text("/v1/chat/completions", body(parts)) == "user:ab"
    # no prompt: no prefix (routed by load)
    for path, raw in [("/models/m", b"{not json"), ("/models/m", body({"inputs": 3})), ("/v1/x", b"[1]")]:
        assert prompt_text(path, raw) == ""
    # malformed chats are the replica's to refuse: the proxy routes them by what text they have
    hostile = {"messages": ["hi", 3, {"role": "user", "content": [{"text": 5}, {"text": "ok"}, "x"]}]}
    assert prompt_text("/v1/chat/completions", body(hostile)) == "user:ok"


def test_each_hash_covers_every_block_before_it():
    text = "a" * 16 + "b" * 16 + "c" * 16 + "tail"
    hashes = prefix_hashes(text, block_chars=16, blocks=8)
    assert len(hashes) == 3  # full blocks only
    assert prefix_hashes(text[:32], 16, 8) == hashes[:2]  # a shared prefix shares its hashes
    assert prefix_hashes("x" + text[1:], 16, 8)[2] != hashes[2]  # a change early changes every later one
    assert prefix_hashes(text, 16, 2) == hashes[:2]  # at most `blocks`
    assert prefix_hashes("short", 16, 8) == []
    assert prefix_hashes("日本語" * 10, 8, 8) == prefix_hashes("日本語" * 10, 8, 8)  # stable across calls


def test_the_shipped_ray_config_scales_the_default_model_between_one_and_two_replicas():
    config = load_config(PROJECT_ROOT / "config" / "ray.yaml")
    default = load_config(PROJECT_ROOT / "config" / "default.yaml")
    assert config.ray is not None and (config.ray.min_replicas, config.ray.max_replicas) == (1, 2)
    assert config.model == default.model and len(config.agents.ports) == 1
    assert (config.server.host, config.server.port) == ("127.0.0.1", 9811)
