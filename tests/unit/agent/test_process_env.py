"""Process environments (agent/process_env.py): HCCL's and MindSpore's Ascend defaults, the values
vllm-mindspore's env_setup sets, reach the agents and cluster schedulers the launcher spawns for an
Ascend model, never a CPU model's, and never over a value the user set. The spawn is mocked (a
Process that records its environment when started): no agent runs here."""

from __future__ import annotations

import os

import pytest

from agent.launcher.model_agents import AgentLauncher
from agent.process_env import ASCEND_DEFAULTS, device_defaults
from config.schema import ServingConfig

pytestmark = pytest.mark.unit
VLLM_MINDSPORE = {
    "HCCL_EXEC_TIMEOUT": "7200",
    "HCCL_OP_EXPANSION_MODE": "AIV",
    "MS_ENABLE_LCCL": "off",
    "MS_NODE_TIMEOUT": "180",
    "MS_ALLOC_CONF": "enable_vmm:true",
}


def test_ascend_gets_the_defaults_the_user_has_not_set():
    assert ASCEND_DEFAULTS == VLLM_MINDSPORE
    assert device_defaults("Ascend", {}) == VLLM_MINDSPORE
    mine = {"HCCL_EXEC_TIMEOUT": "600", "MS_ALLOC_CONF": "enable_vmm:false"}
    assert device_defaults("Ascend", mine) == {k: v for k, v in VLLM_MINDSPORE.items() if k not in mine}
    assert device_defaults("CPU", {}) == device_defaults("GPU", {}) == {}


class RecordedProcess:
    """multiprocessing's Process as the launcher uses it, recording the environment at start()."""

    started: list[dict[str, str]] = []

    def __init__(self, target, name, args):
        self.name, self.pid = name, 4242

    def start(self):
        RecordedProcess.started.append(dict(os.environ))


def spawn_environments(device_target: str, monkeypatch: pytest.MonkeyPatch) -> list[dict[str, str]]:
    """The environments a tensor-parallel group of two starts with: its cluster scheduler's, then
    each agent's."""
    config = ServingConfig.model_validate(
        {
            "runtime": {"device_target": device_target},
            "agents": {"groups": [{"ports": [9820, 9821], "cluster_port": 9830}]},
        }
    )
    launcher = AgentLauncher(config)
    monkeypatch.setattr(launcher.ctx, "Process", RecordedProcess)  # the shared spawn context's
    RecordedProcess.started = []
    launcher.begin_start()
    return RecordedProcess.started


def test_the_launcher_spawns_ascend_agents_with_the_defaults_and_the_users_values(monkeypatch):
    for name in VLLM_MINDSPORE:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HCCL_EXEC_TIMEOUT", "1800")  # the user's own
    scheduler, *agents = spawn_environments("Ascend", monkeypatch)
    assert len(agents) == 2
    for env in [scheduler, *agents]:
        assert {k: env[k] for k in VLLM_MINDSPORE} == VLLM_MINDSPORE | {"HCCL_EXEC_TIMEOUT": "1800"}
    assert [env["MS_ROLE"] for env in [scheduler, *agents]] == ["MS_SCHED", "MS_WORKER", "MS_WORKER"]
    # the launcher's own environment is left as it was
    assert os.environ["HCCL_EXEC_TIMEOUT"] == "1800" and "MS_ALLOC_CONF" not in os.environ


def test_cpu_agents_get_none_of_them(monkeypatch):
    for name in VLLM_MINDSPORE:
        monkeypatch.delenv(name, raising=False)
    for env in spawn_environments("CPU", monkeypatch):
        assert not set(VLLM_MINDSPORE) & set(env)
