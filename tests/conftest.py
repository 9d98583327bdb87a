"""Shared fixtures: MindSpore's process context, tiny checkpoints, and runners built once per session.

The layout mirrors the packages: tests/unit/<package>/ need neither MindSpore nor a process (`make
unit` runs exactly them, and fails a run of them that imports MindSpore); tests/integration/ run
the graphs, agent processes, servers. tests/support/ holds the helpers both import (on sys.path)."""

from __future__ import annotations

import functools
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

TESTS = Path(__file__).parent
UNIT = TESTS / "unit"
sys.path.insert(0, str(TESTS / "support"))  # the tests' own helper modules

from agent.process_env import set_process_defaults  # noqa: E402

set_process_defaults()  # as the agent processes run: before MindSpore loads

from agent.kernels import TARGET_ENV, has_int8_products, testable_targets  # noqa: E402
from agent.model.formats import load_checkpoint  # noqa: E402
from config.schema import PROJECT_ROOT, RuntimeSection  # noqa: E402
from tiny_models import write_tiny_checkpoint  # noqa: E402

if TYPE_CHECKING:
    from agent.runner import ModelRunner

UNIT_ONLY = pytest.StashKey[bool]()
UNIT_MINDSPORE = pytest.StashKey[str]()  # why a unit-only run fails every test, if it must
DEFAULT_MODEL = PROJECT_ROOT / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
GEMMA_MODEL = PROJECT_ROOT / "models" / "gemma-3-270m-q4_k_m.gguf"  # tools.fetch_model --model gemma3-270m

TINY_RUNTIME = RuntimeSection(
    num_slots=4,
    max_seq_len=64,
    prefill_buckets=[16, 64],
    decode_batch_buckets=[1, 2, 4],
    attend_buckets=[32, 64],
    compile_cache_dir=None,
)
DEFAULT_RUNTIME = RuntimeSection(
    num_slots=4,
    max_seq_len=256,
    prefill_buckets=[64, 256],
    decode_batch_buckets=[1, 4],
    attend_buckets=[256],
    compile_cache_dir=None,
)


def is_unit(item: pytest.Item) -> bool:
    return UNIT in Path(item.path).parents


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:  # `-m unit` selects them too
        if is_unit(item):
            item.add_marker(pytest.mark.unit)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """MindSpore's context, configured before the fixtures of the first test that may use it."""
    if not is_unit(item):
        _configure_mindspore()
    elif item.config.stash.get(UNIT_MINDSPORE, ""):
        pytest.fail(item.config.stash[UNIT_MINDSPORE])


@functools.cache
def _configure_mindspore() -> None:
    from agent.runner import configure_mindspore

    configure_mindspore(TINY_RUNTIME)


def pytest_collection_finish(session: pytest.Session) -> None:
    """A run of unit tests only (`make unit`) proves they need no MindSpore: their modules must not
    import it, and the fixture below fails a test that does."""
    unit_only = bool(session.items) and all(is_unit(item) for item in session.items)
    session.config.stash[UNIT_ONLY] = unit_only
    if unit_only and "mindspore" in sys.modules:
        # Each test fails with the reason (an exit here ended every xdist worker with a crash report
        # that named some test and no cause, and ran no test).
        session.config.stash[UNIT_MINDSPORE] = (
            "MindSpore was imported while collecting unit tests: a module in tests/unit (or what it "
            "imports) loads it; make that import lazy or move the test to tests/integration"
        )


def pytest_terminal_summary(terminalreporter) -> None:
    """The slowest /health answer seen during the hostile-request tests (tests/support/attack_watch.py)."""
    from attack_watch import WORST_HEALTH_S

    if WORST_HEALTH_S:
        name, worst = max(WORST_HEALTH_S, key=lambda seen: seen[1])
        terminalreporter.write_line(
            f"slowest /health under attack: {worst * 1000:.0f} ms "
            f"({name or 'unnamed'}; {len(WORST_HEALTH_S)} watches)"
        )


@pytest.fixture(autouse=True)
def _unit_runs_leave_mindspore_out(request: pytest.FixtureRequest):
    loaded_before = "mindspore" in sys.modules
    yield
    if request.config.stash.get(UNIT_ONLY, False) and not loaded_before and "mindspore" in sys.modules:
        pytest.fail("this unit test imported MindSpore: move it to tests/integration or make the import lazy")


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """A test that takes `kernel_target` runs once per kernel target this machine executes that
    compiles other code (agent/kernels: native, then avx2 and portable below it), so a machine with
    AVX-512 proves the AVX2 and the portable code paths too."""
    if "kernel_target" in metafunc.fixturenames:
        metafunc.parametrize("kernel_target", testable_targets(), indirect=True)
    if "int8_kernel_target" in metafunc.fixturenames:
        targets = [name for name in testable_targets() if has_int8_products(name)]
        metafunc.parametrize("int8_kernel_target", targets or [NO_INT8_TARGET], indirect=True)


# A machine whose every target lacks the int8 products (an Arm host: the portable target only).
NO_INT8_TARGET = pytest.param(
    None,
    marks=pytest.mark.skip(reason="no kernel target here has int8 products: they need AVX2 or AVX512-VNNI"),
)


@pytest.fixture
def kernel_target(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The kernel target of this run of the test: graphs built in it call that target's library."""
    monkeypatch.setenv(TARGET_ENV, request.param)
    return request.param


@pytest.fixture
def int8_kernel_target(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """As kernel_target, over the targets with int8 products only (AVX-512 VNNI and AVX2 on an
    AVX-512 machine, AVX2 on an AVX2 one): the tests of int8 activations run at each."""
    monkeypatch.setenv(TARGET_ENV, request.param)
    return request.param


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
def gemma_model_path() -> Path:
    if not GEMMA_MODEL.is_file():
        pytest.fail(f"{GEMMA_MODEL} is missing: run `make setup-dev` (make test does it first)")
    return GEMMA_MODEL


@pytest.fixture(scope="session")
def tiny_gemma_path(tmp_path_factory, gemma_model_path) -> Path:
    """A tiny Gemma-3-shaped GGUF (tests/support/tiny_models.py write_tiny_gemma)."""
    from tiny_models import write_tiny_gemma

    return write_tiny_gemma(tmp_path_factory.mktemp("tiny-gemma") / "tiny-gemma3.gguf", gemma_model_path)


@pytest.fixture(scope="session")
def tiny_llama_runner(tiny_llama_dir) -> ModelRunner:
    from agent.runner import ModelRunner

    return ModelRunner.from_checkpoint(load_checkpoint(tiny_llama_dir), TINY_RUNTIME)


@pytest.fixture(scope="session")
def default_runner(default_model_path) -> ModelRunner:
    from agent.runner import ModelRunner

    return ModelRunner.from_checkpoint(load_checkpoint(default_model_path), DEFAULT_RUNTIME)


@pytest.fixture
def release_all():
    """Runners are shared across tests; free every slot a test used."""
    used: list[ModelRunner] = []
    yield used.append
    for runner in used:
        for slot in list(runner.slots):
            runner.release(slot)
