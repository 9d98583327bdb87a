"""The prefix cache's second tier end to end (runtime.kv_tiers): a long prompt's blocks, evicted
from a tiny KV pool by other prompts, are spilled to the agent's disk tier and restored on the
prompt's next request; its greedy answer and logprobs equal the first time's (computed whole). After
a restart on the same folder, the blocks are found on disk and restored again, same answer, and so are
those of a prompt that was never evicted (a disk tier saves blocks as they are computed); and
with those files corrupted after the agent indexed them, the restores fail and the prompt is
recomputed, same answer. /metrics counts the hits per tier, the bytes and the restore time, and
POST /reset_prefix_cache empties the pool and the tier (files removed, the prompt then computed).
The host tier alone restores too, writing no file."""

import re
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from agent_harness import free_ports, serving_stack, write_config
from tiny_models import write_tiny_checkpoint

# A tiny pool: 8 blocks of 16 positions. Each prompt (a byte-level tokenizer: ~70-90 tokens) with its
# answer takes 5 to 7 of them, so the next one evicts the one before it from the pool (its blocks go
# to the tier). The "first" answer is computed whole: nothing was cached yet.
RUNTIME = {
    "num_slots": 1,
    "max_seq_len": 128,
    "num_blocks": 8,
    "prefill_buckets": [16, 64],
    "attend_buckets": [32, 128],
    "decode_batch_buckets": [1],
    "speculation": {"method": "none"},
}
LONG = "The quiet harbour town kept its lamps lit through the winter storms, and every sailor knew"
# computed last before the restart and never evicted: the disk tier has it all the same (write-through)
FRESH = "A lighthouse keeper wrote letters to the mainland every evening, though no boat came to collect them"
OTHERS = [f"Prompt number {i} talks about something else entirely, {'xyz ' * (8 + i)}" for i in range(3)]
RESTORED = re.compile(r"KV tier: (\d+) blocks restored in [\d.]+ ms, (\d+) missing")


def complete(base: str, prompt: str) -> tuple[str, list[float]]:
    reply = httpx.post(
        f"{base}/v1/completions",
        json={"model": "tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0, "logprobs": 1},
        timeout=120,
    )
    assert reply.status_code == 200, reply.text
    choice = reply.json()["choices"][0]
    return choice["text"], choice["logprobs"]["token_logprobs"]


def restored(log: Path) -> list[tuple[int, int]]:
    """(blocks restored, missing) per step that restored, from the agent's log."""
    return [(int(a), int(b)) for a, b in RESTORED.findall(log.read_text())]


def metrics(base: str) -> dict[tuple[str, tuple], float]:
    """Every sample of /metrics: (name, its labels but the model's, sorted) -> value."""
    reply = httpx.get(f"{base}/metrics", timeout=30)
    assert reply.status_code == 200
    return {
        (s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k != "model"))): s.value
        for family in text_string_to_metric_families(reply.text)
        for s in family.samples
    }


def tier_hits(sample: dict, tier: str) -> float:
    return sample[("llm_serving_kv_tier_hits_total", (("tier", tier),))]


def config(
    directory: Path, model: Path, tiers: Path, host_only: bool = False, **runtime
) -> tuple[Path, str, Path]:
    agent_port, http_port = free_ports(2)
    directory.mkdir()
    bounds = {"host_mb": 4} if host_only else {"disk_mb": 16}
    path = write_config(
        directory,
        model,
        [agent_port],
        runtime={**RUNTIME, **runtime, "kv_tiers": {**bounds, "disk_dir": str(tiers)}},
        server={"port": http_port},
    )
    return path, f"http://127.0.0.1:{http_port}", directory / "logs" / "agent_0.log"


def restored_after_restart(
    directory: Path, model: Path, tiers: Path, fresh: tuple[str, list[float]]
) -> tuple[str, list[float]]:
    """A restart on the same folder: the agent reports what its disk holds, the scheduler restores
    it (LONG's blocks, and FRESH's though never evicted), /metrics counts disk hits; LONG's answer."""
    path, base, log = config(directory, model, tiers)
    with serving_stack(path):
        after = complete(base, LONG)
        hits = restored(log)
        assert hits and sum(n for n, _ in hits) >= 4 and all(m == 0 for _, m in hits), hits
        seen = metrics(base)
        assert tier_hits(seen, "disk") == sum(n for n, _ in hits) and tier_hits(seen, "host") == 0
        assert seen[("llm_serving_prefix_cache_tier_hits_total", ())] == 16 * sum(n for n, _ in hits)
        assert seen[("llm_serving_kv_tier_restore_seconds_count", ())] == len(hits)
        assert seen[("llm_serving_kv_tier_restore_seconds_sum", ())] > 0
        # this config has no host tier: a disk hit stays on disk only
        assert seen[("llm_serving_kv_tier_bytes", (("group", "0"), ("tier", "host")))] == 0
        assert seen[("llm_serving_kv_tier_bytes", (("group", "0"), ("tier", "disk")))] > 0
        assert seen[("llm_serving_kv_tier_misses_total", ())] == 0
        fresh_again = complete(base, FRESH)
        assert fresh_again[0] == fresh[0] and fresh_again[1] == pytest.approx(fresh[1], abs=1e-4)
        fresh_hits = restored(log)[len(hits) :]
        assert fresh_hits and sum(n for n, _ in fresh_hits) >= 4 and all(m == 0 for _, m in fresh_hits)
    return after


def recomputed_when_corrupted(base: str, log: Path, tiers: Path, first: tuple[str, list[float]]) -> None:
    """Files corrupted after the agent indexed them: the restores fail, the sequence is recomputed."""
    for file in tiers.rglob("*.kv"):
        data = bytearray(file.read_bytes())
        data[-8:] = bytes(8)  # the payload's last values: only the checksum tells
        file.write_bytes(bytes(data))
    recomputed = complete(base, LONG)
    hits = restored(log)
    assert hits and all(n == 0 and m > 0 for n, m in hits), hits
    assert "their sequences are recomputed" in (log.parent / "server_app.log").read_text()
    seen = metrics(base)
    assert seen[("llm_serving_kv_tier_misses_total", ())] == sum(m for _, m in hits)
    assert seen[("llm_serving_kv_tier_ignored_files_total", ())] == sum(m for _, m in hits)
    assert tier_hits(seen, "disk") == 0
    assert recomputed[0] == first[0]
    assert recomputed[1] == pytest.approx(first[1], abs=1e-4)


def computed_after_reset(base: str, log: Path, tiers: Path) -> tuple[str, list[float]]:
    """The operator's reset, with LONG in the tier again: the pool's prefixes and the tier's blocks
    go, its files too, and LONG is then computed whole; its answer."""
    for other in OTHERS:
        complete(base, other)
    restores = restored(log)
    dropped = httpx.post(f"{base}/reset_prefix_cache", timeout=30)
    assert dropped.status_code == 200, dropped.text
    body = dropped.json()
    assert body["model"] == "tiny" and body["skipped_groups"] == []
    assert body["tier_blocks"] >= 4 and body["pool_blocks"] >= 1, body
    assert not list(tiers.rglob("*.kv"))
    seen = metrics(base)
    assert seen[("llm_serving_kv_tier_bytes", (("group", "0"), ("tier", "disk")))] == 0
    assert seen[("llm_serving_kv_tier_bytes", (("group", "0"), ("tier", "host")))] == 0
    hit_tokens = seen[("llm_serving_prefix_cache_hits_total", ())]
    after_reset = complete(base, LONG)
    assert restored(log) == restores
    assert metrics(base)[("llm_serving_prefix_cache_hits_total", ())] == hit_tokens
    return after_reset


def test_evicted_prefix_is_restored_from_the_tier_and_answers_as_computed(tmp_path, tiny_llama_dir):
    tiers = tmp_path / "tiers"
    path, base, log = config(tmp_path / "first", tiny_llama_dir, tiers)
    with serving_stack(path):
        first = complete(base, LONG)
        assert restored(log) == []
        for other in OTHERS:  # each evicts the one before: LONG's blocks go to the tier
            complete(base, other)
        again = complete(base, LONG)
        hits = restored(log)
        assert hits and sum(n for n, _ in hits) >= 4 and all(m == 0 for _, m in hits), hits
        assert again[0] == first[0]
        assert again[1] == pytest.approx(first[1], abs=1e-4)
        fresh = complete(base, FRESH)
    assert list((tiers).rglob("*.kv")), "the disk tier kept no file"

    after = restored_after_restart(tmp_path / "second", tiny_llama_dir, tiers, fresh)
    assert after[0] == first[0]
    assert after[1] == pytest.approx(first[1], abs=1e-4)

    path, base, log = config(tmp_path / "third", tiny_llama_dir, tiers)
    with serving_stack(path):
        recomputed_when_corrupted(base, log, tiers, first)
        after_reset = computed_after_reset(base, log, tiers)
    assert after_reset[0] == first[0] and after_reset[1] == pytest.approx(first[1], abs=1e-4)


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "q8_0"])
def test_the_host_tier_alone_restores_and_writes_no_file(tmp_path, tiny_llama_dir, kv_cache_dtype):
    """With runtime.kv_cache_dtype q8_0 (a tiny Llama with heads of 32 values, a q8_0 block each), prefix
    caching and the tier carry the quantized blocks, and the restored prompt answers as computed."""
    model = tiny_llama_dir
    if kv_cache_dtype == "q8_0":
        (tmp_path / "model").mkdir()
        model = write_tiny_checkpoint(tmp_path / "model", "llama", seed=1, hidden=128)
    tiers = tmp_path / "tiers"
    path, base, log = config(tmp_path / "host", model, tiers, host_only=True, kv_cache_dtype=kv_cache_dtype)
    with serving_stack(path):
        first = complete(base, LONG)
        for other in OTHERS:
            complete(base, other)
        again = complete(base, LONG)
        hits = restored(log)
        seen = metrics(base)
    assert hits and sum(n for n, _ in hits) >= 4 and all(m == 0 for _, m in hits), hits
    assert tier_hits(seen, "host") == sum(n for n, _ in hits) and tier_hits(seen, "disk") == 0
    assert seen[("llm_serving_kv_tier_bytes", (("group", "0"), ("tier", "disk")))] == 0
    assert seen[("llm_serving_kv_tier_bytes", (("group", "0"), ("tier", "host")))] > 0
    assert again[0] == first[0] and again[1] == pytest.approx(first[1], abs=1e-4)
    assert not tiers.exists()
    assert ("(q8_0)" in log.read_text()) == (kv_cache_dtype == "q8_0")  # the memory plan names it
