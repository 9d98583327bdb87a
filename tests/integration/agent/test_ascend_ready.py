"""Ready for Ascend, as far as a machine without an NPU can check it: the launcher with
device_target Ascend stops in seconds with the preflight's message (the real start_agent.py, on
this machine's CPU-only MindSpore), and an agent's MindSpore context on a device target (the
preflight first, the memory pool capped at the budget, the compile level set). MindSpore's device
calls are mocked where a device would answer: no NPU or CANN toolkit exists here."""

from __future__ import annotations

import time

import mindspore as ms
import numpy as np
import pytest
from mindspore import ops

from agent.contract.sampling import SamplingParams
from agent.graphs.step_graphs import TopKGraph
from agent.launcher.preflight import DeviceProbe, DeviceUnavailable, probe
from agent.runner import configure_mindspore
from agent.sampling import SlotSampler
from agent_harness import LauncherProcess, free_ports, write_config
from config.schema import RuntimeSection

ASCEND = dict(device_target="Ascend", dtype="bfloat16", memory_budget_mb=58000, compile_cache_dir=None)


def test_the_launcher_on_a_machine_without_cann_stops_in_seconds_with_the_fix(tmp_path):
    """No agent is spawned (no agent log), no traceback, exit code 1: the user reads what to
    install. Bounded generously (2 cores shared): the probe imports MindSpore once (~5 s here)."""
    path = write_config(
        tmp_path,
        tmp_path / "no-model",
        free_ports(2),
        runtime={"device_target": "Ascend", "dtype": "bfloat16"},
    )
    start = time.monotonic()
    launcher = LauncherProcess(path)
    try:
        code = launcher.process.wait(timeout=120)
    finally:
        launcher.close()
    took = time.monotonic() - start
    output = launcher.output()
    assert code == 1, output
    assert took < 60, f"{took:.0f}s"
    assert (
        "preflight: device_target Ascend: MindSpore 2.10.0 cannot use Ascend devices (Load dynamic "
        "library: libmindspore_ascend.so.2 failed. libge_runner.so: cannot open shared object file"
    ) in output
    assert output.rstrip().endswith(
        "install the CANN toolkit and MindSpore's Ascend wheel, then `source "
        "/usr/local/Ascend/ascend-toolkit/set_env.sh` before starting (README: On Ascend); or set "
        "runtime.device_target: CPU"
    )
    assert "Traceback" not in output
    assert not list((tmp_path / "logs").glob("agent_[0-9]*.log"))


def test_the_probe_reads_mindsporess_device_context(monkeypatch):
    """Here the real answer (the Ascend plugin did not load: CANN missing), then MindSpore's
    is_available / device_count mocked as an Atlas 800 would answer, and a driver that fails."""
    found = probe("Ascend")
    assert not found.available and "libge_runner.so" in found.detail and found.version == ms.__version__
    ascend = ms.device_context.ascend
    monkeypatch.setattr(ascend, "is_available", lambda: True)
    monkeypatch.setattr(ascend, "device_count", lambda: 8)
    assert probe("Ascend") == DeviceProbe("Ascend", True, 8, "", ms.__version__)

    def broken():
        raise RuntimeError("drvGetDevNum failed")

    monkeypatch.setattr(ascend, "device_count", broken)
    assert probe("Ascend").count is None


@pytest.fixture
def mindspore_calls(monkeypatch):
    """MindSpore's context calls recorded instead of made (a mock: no NPU here), with an 8-device
    Ascend runtime answering the preflight."""
    calls: list[tuple] = []
    monkeypatch.setattr(ms, "set_device", lambda *args: calls.append(("set_device", *args)))
    monkeypatch.setattr(ms, "set_context", lambda **kwargs: calls.append(("set_context", kwargs)))
    monkeypatch.setattr(ms.runtime, "set_memory", lambda **kwargs: calls.append(("set_memory", kwargs)))
    monkeypatch.setattr(ms.device_context.ascend, "is_available", lambda: True)
    monkeypatch.setattr(ms.device_context.ascend, "device_count", lambda: 8)
    return calls


def test_an_agent_on_ascend_caps_its_memory_pool_and_sets_the_compile_level(mindspore_calls):
    configure_mindspore(RuntimeSection(**ASCEND), device_id=3)
    assert mindspore_calls == [
        ("set_context", {"mode": ms.GRAPH_MODE}),
        ("set_device", "Ascend", 3),
        # the paged backend's kernels exist only as MindSpore's internal inference kernels
        ("set_context", {"jit_config": {"jit_level": "O0", "infer_boost": "on"}}),
        ("set_memory", {"max_size": "56.641GB"}),  # 58000 MB, rounded up
    ]
    mindspore_calls.clear()
    gather = {**ASCEND, "decode_attention": "gather", "jit_level": "O2", "memory_budget_mb": None}
    configure_mindspore(RuntimeSection(**gather), 0)
    assert mindspore_calls[2:] == [("set_context", {"jit_config": {"jit_level": "O2"}})]  # no cap
    mindspore_calls.clear()
    configure_mindspore(RuntimeSection(compile_cache_dir=None), 0)  # CPU: as before
    assert mindspore_calls == [("set_context", {"mode": ms.GRAPH_MODE}), ("set_device", "CPU", 0)]


def test_paged_attention_refuses_the_graph_sinking_compile_levels():
    """O1 and O2 select no internal kernel: a paged configuration at either is refused, saying why."""
    for level in ("O1", "O2"):
        with pytest.raises(
            ValueError, match=f"jit_level {level} with paged attention: .* only the kernel-by-kernel"
        ):
            RuntimeSection(**{**ASCEND, "jit_level": level})
    assert RuntimeSection(**{**ASCEND, "jit_level": "O0"}).jit_config == {
        "jit_level": "O0",
        "infer_boost": "on",
    }
    assert RuntimeSection(compile_cache_dir=None).jit_config == {}  # CPU: MindSpore's own


def test_an_agent_past_the_visible_devices_stops_before_mindspore_touches_one(mindspore_calls):
    with pytest.raises(DeviceUnavailable) as failure:
        configure_mindspore(RuntimeSection(**ASCEND), device_id=9)
    assert str(failure.value) == (
        "Ascend device ids 9 (agents.start_device_id + this agent's rank): the runtime sees 8 Ascend "
        "devices (0..7); lower agents.start_device_id or run fewer agents"
    )
    assert mindspore_calls == []


def test_bfloat16_is_accepted_on_ascend_and_refused_on_cpu():
    assert RuntimeSection(**ASCEND).dtype == "bfloat16"
    with pytest.raises(ValueError, match="bfloat16 has no MindSpore CPU kernels"):
        RuntimeSection(dtype="bfloat16", matmul="mindspore", decode_attention="gather")


def test_bfloat16_logits_reach_the_sampler_as_float32_and_choose_as_the_rounded_values():
    """MindSpore's CPU cannot compute in bfloat16 (no MatMul, Softmax, TopK kernels: the graphs
    cannot run here in it), so this checks the boundary the graphs end at: bfloat16 logits cast to
    float32 (as the model's logits are on every dtype) go to the top-k graph and the host sampler,
    which choose exactly as on the bfloat16-rounded values (float32 holds every bfloat16 value)."""
    rng = np.random.default_rng(7)
    logits = rng.normal(0, 4, (2, 1000)).astype(np.float32)
    half = ms.Tensor(logits).astype(ms.bfloat16)
    with pytest.raises(TypeError, match="Unsupported data type"):
        ops.topk(half, 4)  # what the cast spares the post-process graphs
    rows = ops.cast(half, ms.float32)
    host = rows.asnumpy()
    assert host.dtype == np.float32
    rounded = half.asnumpy().astype(np.float64)  # the bfloat16 values, exactly
    np.testing.assert_array_equal(host, rounded)
    assert np.abs(host - logits).max() > 0  # the rounding is real

    greedy = SlotSampler(SamplingParams(logprobs=2), [1], 1000)
    assert greedy.choose_from_logits(host[0]) == int(np.argmax(rounded[0]))
    best = rounded[0].max()
    expected = best - (best + np.log(np.exp(rounded[0] - best).sum()))  # log-softmax at the best
    assert greedy.last is not None and greedy.last.logprob == pytest.approx(expected, abs=1e-9)
    values, ids = (t.asnumpy() for t in TopKGraph(64)(rows))
    sampled = SamplingParams(do_sample=True, temperature=0.8, top_k=20, seed=11)
    from_topk = SlotSampler(sampled, [1], 1000).choose(values[1], ids[1])
    from_logits = SlotSampler(sampled, [1], 1000).choose_from_logits(host[1])
    assert from_topk == from_logits and from_topk in ids[1, :20]
