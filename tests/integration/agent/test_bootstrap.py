"""The agent's start-up order (agent/bootstrap.py, run by agent/process.py): a tensor-parallel rank
on Ascend sets its device, then joins its group's cluster (MindSpore's init(): HCCL), and only then
loads its share of the weights, so that one rank's slow load never counts against the cluster's
connect timeout. A mock: no NPU or HCCL exists here, so MindSpore's device and communication calls
and the weights' loading are recorded instead of made."""

from __future__ import annotations

import logging

import mindspore as ms
import mindspore.communication
import pytest

import agent.bootstrap
from agent.process import _start
from config.schema import ServingConfig


class WeightsLoaded(Exception):
    """Raised where the weights would load: the order up to there is what the test reads."""


def test_a_tensor_parallel_rank_joins_its_cluster_before_it_loads_its_weights(monkeypatch, tmp_path):
    calls: list[tuple] = []
    monkeypatch.setattr(ms, "set_device", lambda *args: calls.append(("set_device", *args)))
    monkeypatch.setattr(ms, "set_context", lambda **kwargs: None)
    monkeypatch.setattr(ms.runtime, "set_memory", lambda **kwargs: calls.append(("set_memory",)))
    monkeypatch.setattr(ms.device_context.ascend, "is_available", lambda: True)
    monkeypatch.setattr(ms.device_context.ascend, "device_count", lambda: 8)
    monkeypatch.setattr(mindspore.communication, "init", lambda *args: calls.append(("init",)))
    monkeypatch.setattr(mindspore.communication, "get_rank", lambda *args: 1)
    monkeypatch.setattr(mindspore.communication, "get_group_size", lambda *args: 2)

    def load_checkpoint(path, progress=None, split=None, dtype=None):
        calls.append(("load", split.rank, split.size))
        raise WeightsLoaded

    monkeypatch.setattr(agent.bootstrap, "load_checkpoint", load_checkpoint)
    config = ServingConfig.model_validate(
        {
            "model": {"path": str(tmp_path / "Qwen3-8B")},
            "runtime": {"device_target": "Ascend", "dtype": "bfloat16", "memory_budget_mb": 58000},
            "agents": {"groups": [{"ports": [9820, 9821], "cluster_port": 9830}], "start_device_id": 4},
            "logging": {"dir": str(tmp_path)},
        }
    )
    with pytest.raises(WeightsLoaded):
        _start(config, 1, 9821, logging.getLogger("test_bootstrap"))
    # rank 1 of the group: device start_device_id + 1
    assert calls == [("set_device", "Ascend", 5), ("set_memory",), ("init",), ("load", 1, 2)]


def test_an_agent_whose_pool_peaked_over_its_plan_after_warm_up_refuses_to_start(monkeypatch):
    """After warm-up on a device, MindSpore's pool peak is held to the plan: over it, the agent
    stops with the numbers and the blocks that would fit; under it, it starts. A mock: no NPU
    here, so the pool's statistics are given, not measured; on CPU they are not read at all."""
    from test_memory_plan import ascend_example_runtime, llama2

    from agent.memory_plan import MemoryPlanError, plan_memory
    from config.schema import RuntimeSection

    runtime = ascend_example_runtime()
    spec = llama2(32, 4096, 32, 32, 11008)
    _, plan = plan_memory(spec, runtime)
    monkeypatch.setattr(ms.runtime, "max_memory_reserved", lambda: 60 << 30)
    peak_mb = int(plan.pooled_mb) + 3000
    monkeypatch.setattr(ms.runtime, "max_memory_allocated", lambda: peak_mb << 20)
    with pytest.raises(MemoryPlanError, match="over") as refused:
        agent.bootstrap.check_device_peak(runtime, plan)
    assert f"peaked at {peak_mb} MB allocated" in str(refused.value)
    monkeypatch.setattr(ms.runtime, "max_memory_allocated", lambda: int(plan.pooled_mb - 1) << 20)
    agent.bootstrap.check_device_peak(runtime, plan)
    monkeypatch.setattr(ms.runtime, "max_memory_allocated", lambda: 1 << 50)
    agent.bootstrap.check_device_peak(RuntimeSection(compile_cache_dir=None), plan)  # CPU: unread
