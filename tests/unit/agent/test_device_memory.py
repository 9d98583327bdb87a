"""Device memory in the launcher (agent/launcher/memory_budget.py): on Ascend/GPU a model's
runtime.memory_budget_mb is held on each of its devices, within agents.device_memory_mb and beside
the other models' agents on the same device, never against the host's available memory. No NPU
exists here: the launcher's checks are pure, so these run the real code on an Ascend config
without any agent being spawned (a refused load spawns nothing)."""

from __future__ import annotations

import pytest

from agent.contract import launcher_control as control
from agent.launcher import memory_budget
from agent.launcher.memory_budget import device_refusal, refusal
from agent.launcher.models import LaunchedModels
from config.schema import ServingConfig

pytestmark = pytest.mark.unit


def test_a_budget_larger_than_the_device_is_refused_before_any_agent_starts(tmp_path):
    config = ServingConfig.model_validate(
        {
            "runtime": {"device_target": "Ascend", "dtype": "float16", "memory_budget_mb": 70000},
            "agents": {"ports": [9820, 9821], "start_device_id": 2, "device_memory_mb": 65536},
            "logging": {"dir": str(tmp_path)},
        }
    )
    models = LaunchedModels(config)
    model = next(iter(models.models.values()))
    assert models._load(model) == (
        "model 'smollm2-135m-instruct' needs 70000 MB (runtime.memory_budget_mb) on device 2; 65536 MB "
        "of its 65536 MB (agents.device_memory_mb) is left (no other model): lower memory_budget_mb or "
        "unload a model on that device"
    )
    assert model.state == control.UNAVAILABLE and model.launcher is None and model.devices == ()


def test_models_sharing_a_device_add_up_on_it():
    held = {"llama": (40000, [0, 1]), "qwen": (20000, [1])}
    assert device_refusal("gemma", 20000, [2, 3], 65536, held) is None
    assert device_refusal("gemma", 20000, [0], 65536, held) is None  # 40000 + 20000 of 65536
    assert device_refusal("gemma", 20000, [0, 1], 65536, held) == (
        "model 'gemma' needs 20000 MB (runtime.memory_budget_mb) on device 1; 5536 MB of its 65536 MB "
        "(agents.device_memory_mb) is left (llama 40000 MB, qwen 20000 MB): lower memory_budget_mb or "
        "unload a model on that device"
    )
    assert device_refusal("gemma", None, [1], 65536, held) is None  # no plan to compare
    assert device_refusal("gemma", 20000, [1], None, held) is None  # the card's size not given


def test_a_device_budget_is_not_held_against_the_hosts_memory(monkeypatch):
    """A 58 GB budget on each of 8 NPUs is device memory: a host with 1 GB available refuses it
    on CPU, not on a device target (agents.memory_limit_mb, when set, still applies)."""
    monkeypatch.setattr(memory_budget, "available_mb", lambda: 1024.0)
    assert "the machine has 1024 MB available" in refusal("llama", 8 * 58000, 8, None, {}, {})
    assert refusal("llama", 8 * 58000, 8, None, {}, {}, host=False) is None
    assert "of agents.memory_limit_mb" in refusal("llama", 8 * 58000, 8, 100000, {}, {}, host=False)
