"""MindIR export (tools.export) and agents running the exported files instead of graphs from code."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from conftest import TINY_RUNTIME

import pooling_models
import runner_calls as calls
from agent.contract.sampling import SamplingParams
from agent.graphs.mindir import EXPORT_FORMAT, GraphExporter, MindIRError, read_known_answer
from agent.known_answer import KnownAnswerError
from agent.model.detokenizer import IncrementalDetokenizer
from agent.model.formats import load_checkpoint
from agent.model.tokenizer import load_tokenizer
from agent.runner import ModelRunner
from agent.warm_up import warm_up
from agent_harness import free_ports, serving_stack, write_config
from config import ConfigError, load_config
from config.schema import PROJECT_ROOT, ModelSection, RuntimeSection
from http_client import post
from tiny_models import write_tiny_checkpoint

PROMPTS = [[5, 17, 33, 90, 12], [7, 8, 9], list(range(20, 60))]


def run_export(config_path: Path, output: Path) -> tuple[str, dict]:
    """`python -m tools.export`; returns its output and the model section it printed."""
    done = subprocess.run(
        [sys.executable, "-m", "tools.export", "--config", str(config_path), "--output", str(output)],
        cwd=PROJECT_ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout, yaml.safe_load(done.stdout[done.stdout.index("model:") :])["model"]


@pytest.fixture(scope="module")
def exported(tmp_path_factory, tiny_llama_dir):
    """`python -m tools.export` on the tiny model; yields (config path, the model section it printed)."""
    directory = tmp_path_factory.mktemp("mindir")
    config_path = write_config(directory, tiny_llama_dir, free_ports(1))
    stdout, section = run_export(config_path, directory / "graphs")
    assert "graph 9/9 top-k 400" in stdout  # one progress line per graph
    return config_path, section


def refused_export(config_path: Path, output: Path) -> str:
    """`python -m tools.export` that must fail before writing anything; returns its stderr."""
    done = subprocess.run(
        [sys.executable, "-m", "tools.export", "--config", str(config_path), "--output", str(output)],
        cwd=PROJECT_ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 1 and not output.exists(), done.stderr
    return done.stderr


def test_a_q8_0_cache_is_not_exported(tmp_path, tiny_llama_dir):
    """A MindIR export keeps float caches, which served MindIR graphs assume: q8_0 is refused by name."""
    config_path = write_config(tmp_path, tiny_llama_dir, free_ports(1), runtime={"kv_cache_dtype": "q8_0"})
    assert "kv_cache_dtype q8_0 is not exported" in refused_export(config_path, tmp_path / "out")


def test_an_encoder_is_not_exported(tmp_path):
    """An encoder's only output is its hidden states, which MindIR graphs do not keep: refused by name."""
    _, gguf, _ = pooling_models.write_gemma_embedder(tmp_path / "encoder")
    config_path = write_config(tmp_path, gguf, free_ports(1))
    assert "encoders are not exported to MindIR" in refused_export(config_path, tmp_path / "out")


def run(runner: ModelRunner) -> list:
    """Greedy and seeded-sampling sequences decoded together, one slot released and reused."""
    calls.prefill(runner, 0, PROMPTS[0], SamplingParams())
    calls.prefill(runner, 1, PROMPTS[1], SamplingParams(do_sample=True, top_k=20, temperature=0.8, seed=3))
    steps = [calls.decode(runner, [0, 1]) for _ in range(6)]
    runner.release(1)
    calls.prefill(runner, 1, PROMPTS[2], SamplingParams())
    steps += [calls.decode(runner, [1, 0]) for _ in range(6)]
    for slot in (0, 1):
        runner.release(slot)
    return steps


def test_the_paged_backend_is_not_exported(tmp_path):
    """Paged attention's graphs run in MindSpore's predict phase from code: an export is refused by
    name before any graph is built (no checkpoint is read)."""
    paged = RuntimeSection(decode_attention="paged", matmul="mindspore", compile_cache_dir=None)
    with pytest.raises(MindIRError, match="paged backend's graphs .* are not exported"):
        GraphExporter(None, paged, tmp_path)  # type: ignore[arg-type]


def test_exported_graphs_give_the_tokens_of_the_graphs_from_code(exported, tiny_llama_dir):
    _, section = exported
    files = ModelSection(**section)
    assert len(files.prefill_model) == 2 and len(files.decode_model) == 3 and len(files.topk_model) == 3
    from_files = ModelRunner.from_mindir(files, TINY_RUNTIME)
    from_code = ModelRunner.from_checkpoint(load_checkpoint(tiny_llama_dir), TINY_RUNTIME)
    assert run(from_files) == run(from_code)
    assert from_files.graphs.cache_bytes() == from_code.graphs.cache_bytes()


def test_agents_serve_from_mindir_files(exported, tmp_path, tiny_llama_dir):
    """start_agent.py + start_server.py with the model section tools.export printed; the answer
    equals the one of graphs built from code."""
    agent_port, http_port = free_ports(2)
    _, section = exported
    path = write_config(tmp_path, tiny_llama_dir, [agent_port], model=section, server={"port": http_port})
    runner = ModelRunner.from_checkpoint(load_checkpoint(tiny_llama_dir), TINY_RUNTIME)
    tokenizer = load_tokenizer(tiny_llama_dir)
    prompt = tokenizer.encode("The capital of France is")
    expected = [calls.prefill(runner, 0, prompt, SamplingParams())] + [
        calls.decode(runner, [0])[0] for _ in range(9)
    ]
    with serving_stack(path) as (agents, _server):
        assert "MindIR graphs loaded" in (tmp_path / "logs" / "agent_0.log").read_text()
        answer = post(
            f"http://127.0.0.1:{http_port}/models/tiny/generate",
            {"inputs": "The capital of France is", "parameters": {"max_new_tokens": 10, "ignore_eos": True}},
        )
    assert answer.status_code == 200, answer.text
    detokenizer = IncrementalDetokenizer(tokenizer)  # the server's text of those tokens
    for token in expected:
        if token not in set(tokenizer.eos_ids) | set(runner.spec.eos_ids):
            detokenizer.add(token)
    detokenizer.flush()
    assert answer.json()["generated_text"] == detokenizer.text


def test_mismatched_runtime_is_refused_naming_the_setting(exported):
    _, section = exported
    runtime = TINY_RUNTIME.model_copy(update={"num_slots": 2, "decode_batch_buckets": [1, 2]})
    with pytest.raises(MindIRError, match="num_slots: exported 4, configured 2"):
        ModelRunner.from_mindir(ModelSection(**section), runtime)
    with pytest.raises(MindIRError, match="block_size: exported 16, configured 8"):
        ModelRunner.from_mindir(ModelSection(**section), TINY_RUNTIME.model_copy(update={"block_size": 8}))


def test_graphs_of_an_older_export_format_are_refused(exported, tmp_path):
    """Graphs whose inputs or outputs differ from what this version passes: export again."""
    _, section = exported
    files = ModelSection(**section)
    manifest_path = files.argmax_model.parent / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    del manifest["format"]
    manifest_path.write_text(json.dumps(manifest))
    try:
        with pytest.raises(
            MindIRError, match=rf"exported by another version \(format 1, this one reads {EXPORT_FORMAT}\)"
        ):
            ModelRunner.from_mindir(files, TINY_RUNTIME)
    finally:
        manifest["format"] = EXPORT_FORMAT
        manifest_path.write_text(json.dumps(manifest))


def test_files_of_another_export_fail_the_known_answer_check(exported, tmp_path, tiny_llama_dir):
    """The graph files of a model of the same shapes (other weights) under this export's manifest and
    tokenizer: the warm-up refuses them instead of serving the other model's answers. (Mixing single
    files does no harm: at load every file's weights are pointed at the first file's.)"""
    _, section = exported
    files = ModelSection(**section)
    other_dir = write_tiny_checkpoint(tmp_path / "other", "llama", seed=7)
    other = ModelSection(
        **run_export(write_config(tmp_path, other_dir, free_ports(1)), tmp_path / "other-graphs")[1]
    )
    mixed = tmp_path / "mixed"
    shutil.copytree(files.argmax_model.parent, mixed)
    for path in other.argmax_model.parent.glob("*.mindir"):
        shutil.copy(path, mixed / path.name)
    mixed_files = ModelSection(
        **{
            **section,
            **{
                kind: [str(mixed / Path(p).name) for p in section[kind]]
                for kind in ("prefill_model", "decode_model", "topk_model")
            },
            "argmax_model": str(mixed / Path(section["argmax_model"]).name),
        }
    )
    runner = ModelRunner.from_mindir(mixed_files, TINY_RUNTIME)
    with pytest.raises(KnownAnswerError, match="the prefill length 16 graph disagrees"):
        warm_up(runner, lambda _line: None, known=read_known_answer(mixed_files))
    warm_up(ModelRunner.from_mindir(files, TINY_RUNTIME), lambda _line: None, known=read_known_answer(files))


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("mindspore", "2.0.0", "exported with MindSpore 2.0.0"),
        ("kernels", "0123456789abcdef", "call CPU kernels of build 0123456789abcdef"),
    ],
)
def test_exports_of_another_mindspore_or_kernel_build_are_refused(exported, field, value, message):
    _, section = exported
    files = ModelSection(**section)
    manifest_path = files.argmax_model.parent / "manifest.json"
    original = manifest_path.read_text()
    manifest_path.write_text(json.dumps({**json.loads(original), field: value}))
    try:
        with pytest.raises(MindIRError, match=message):
            ModelRunner.from_mindir(files, TINY_RUNTIME)
    finally:
        manifest_path.write_text(original)


def test_missing_graphs_and_partial_sections_are_refused(exported, tmp_path):
    config_path, section = exported
    short = {**section, "prefill_model": section["prefill_model"][:1]}
    with pytest.raises(MindIRError, match="lack graphs for: prefill length 64"):
        ModelRunner.from_mindir(ModelSection(**short), TINY_RUNTIME)
    swapped = {**section, "argmax_model": section["topk_model"][0]}
    with pytest.raises(MindIRError, match="not a argmax_model graph"):
        ModelRunner.from_mindir(ModelSection(**swapped), TINY_RUNTIME)
    raw = yaml.safe_load(config_path.read_text())
    raw["model"].update({"argmax_model": section["argmax_model"]})
    partial = tmp_path / "partial.yaml"
    partial.write_text(yaml.safe_dump(raw))
    with pytest.raises(ConfigError, match="come together"):
        load_config(partial)
