"""Shared fixtures: MindSpore's process context, tiny checkpoints, and runners built once per session."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # tests' own helper modules

from agent.process_env import set_process_defaults  # noqa: E402

set_process_defaults()  # as the agent processes run: before MindSpore loads

from agent.model.formats import load_checkpoint  # noqa: E402
from agent.runner import ModelRunner, configure_mindspore  # noqa: E402
from config.schema import PROJECT_ROOT, RuntimeSection  # noqa: E402
from tiny_models import write_tiny_checkpoint  # noqa: E402

DEFAULT_MODEL = PROJECT_ROOT / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"

TINY_RUNTIME = RuntimeSection(num_slots=4, max_seq_len=64, prefill_buckets=[16, 64],
                              decode_batch_buckets=[1, 2, 4], attend_buckets=[32, 64],
                              compile_cache_dir=None)
DEFAULT_RUNTIME = RuntimeSection(num_slots=4, max_seq_len=256, prefill_buckets=[64, 256],
                                 decode_batch_buckets=[1, 4], attend_buckets=[256],
                                 compile_cache_dir=None)


@pytest.fixture(scope="session", autouse=True)
def mindspore_context():
    configure_mindspore(TINY_RUNTIME)


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> Path:
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny-llama"), "llama", seed=1)


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory) -> Path:
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny-qwen2"), "qwen2", seed=2, tied=True)


@pytest.fixture(scope="session")
def default_model_path() -> Path:
    if not DEFAULT_MODEL.is_file():
        pytest.fail(f"{DEFAULT_MODEL} is missing: run `make setup` (make test does it first)")
    return DEFAULT_MODEL


@pytest.fixture(scope="session")
def tiny_llama_runner(tiny_llama_dir) -> ModelRunner:
    return ModelRunner(load_checkpoint(tiny_llama_dir), TINY_RUNTIME)


@pytest.fixture(scope="session")
def default_runner(default_model_path) -> ModelRunner:
    return ModelRunner(load_checkpoint(default_model_path), DEFAULT_RUNTIME)


@pytest.fixture
def release_all():
    """Runners are shared across tests; free every slot a test used."""
    used: list[ModelRunner] = []
    yield used.append
    for runner in used:
        for slot in list(runner.slots):
            runner.release(slot)
