"""The Ascend/GPU preflight (agent/launcher/preflight.py): one line per problem, with its fix, from
what MindSpore reports. MindSpore's answers are mocked (DeviceProbe values, and probe_in_child in
check_config) because no NPU or CANN toolkit exists here; the real launcher on this machine is
tests/integration/agent/test_ascend_ready.py."""

from __future__ import annotations

import pytest

from agent.launcher import preflight
from agent.launcher.preflight import DeviceProbe, problems, visible_devices
from config.schema import ServingConfig

pytestmark = pytest.mark.unit
EIGHT = DeviceProbe("Ascend", True, 8, "", "2.10.0")
SOURCE = "agents.start_device_id 0 + agent ranks 0..3"


def test_a_missing_runtime_names_the_plugin_error_and_the_install_steps():
    missing = DeviceProbe("Ascend", False, 0, "libge_runner.so: cannot open shared object file", "2.10.0")
    assert problems("Ascend", [0, 1], missing, None, SOURCE) == [
        "device_target Ascend: MindSpore 2.10.0 cannot use Ascend devices (libge_runner.so: cannot "
        "open shared object file): install the CANN toolkit and MindSpore's Ascend wheel, then "
        "`source /usr/local/Ascend/ascend-toolkit/set_env.sh` before starting (README: On Ascend); "
        "or set runtime.device_target: CPU"
    ]
    no_plugin = DeviceProbe("GPU", False, 0, "", "2.10.0")
    assert problems("GPU", [0], no_plugin, None, SOURCE)[0].startswith(
        "device_target GPU: MindSpore 2.10.0 cannot use GPU devices (this build has no GPU support): "
        "install CUDA and MindSpore's GPU wheel"
    )


def test_no_device_and_a_failed_count_point_at_the_driver():
    assert problems("Ascend", [0], DeviceProbe("Ascend", True, 0), None, SOURCE) == [
        "device_target Ascend: the Ascend runtime sees no device: check the driver (`npu-smi info` "
        "lists the NPUs)"
    ]
    broken = DeviceProbe("Ascend", True, None, "RuntimeError: drvGetDevNum failed")
    assert problems("Ascend", [0], broken, None, SOURCE) == [
        "device_target Ascend: MindSpore's Ascend runtime loaded but could not count the devices "
        "(RuntimeError: drvGetDevNum failed): check the driver (`npu-smi info` lists the NPUs)"
    ]


def test_agents_past_the_device_count_are_named_with_the_fix():
    assert problems("Ascend", [0, 1, 2, 3], EIGHT, None, SOURCE) == []
    source = "agents.start_device_id 6 + agent ranks 0..3"
    assert problems("Ascend", [6, 7, 8, 9], EIGHT, None, source) == [
        "Ascend device ids 6..9 (agents.start_device_id 6 + agent ranks 0..3): the runtime sees 8 "
        "Ascend devices (0..7); lower agents.start_device_id or run fewer agents"
    ]


def test_visible_devices_renumber_from_zero():
    """ASCEND_RT_VISIBLE_DEVICES=4,5,6,7 on an 8-device machine: ids 0..3 are devices 4..7, so 4
    agents from id 0 fit and a fifth does not; CANN stops reading at the first entry that is not a
    device (a space, an id past the count, a repeat)."""
    assert visible_devices("ASCEND_RT_VISIBLE_DEVICES", "4,5,6,7", 8) == ([4, 5, 6, 7], None)
    assert problems("Ascend", [0, 1, 2, 3], EIGHT, "4,5,6,7", SOURCE) == []
    assert problems(
        "Ascend", [0, 1, 2, 3, 4], EIGHT, "4,5,6,7", "agents.start_device_id 0 + agent ranks 0..4"
    ) == [
        "Ascend device ids 0..4 (agents.start_device_id 0 + agent ranks 0..4): "
        "ASCEND_RT_VISIBLE_DEVICES=4,5,6,7 makes 4 of the machine's 8 devices visible, renumbered "
        "from 0 (0 is device 4, 1 is device 5, 2 is device 6, 3 is device 7); list 5 devices there, "
        "or lower agents.start_device_id or run fewer agents"
    ]
    # a physical id as start_device_id: the agents' device 4 is past the 2 visible ones
    assert "list 6 devices there" in problems("Ascend", [4, 5], EIGHT, "4,5", SOURCE)[0]


def test_a_visible_devices_list_the_runtime_cuts_short_is_a_problem():
    two = "agents.start_device_id 0 + agent ranks 0..1"
    assert problems("Ascend", [0, 1], EIGHT, "4,9", two) == [
        "ASCEND_RT_VISIBLE_DEVICES=4,9: '9' is not a device of this machine (0..7), so the runtime "
        "reads only 4; list distinct device ids 0..7 separated by commas without spaces, or unset "
        "ASCEND_RT_VISIBLE_DEVICES",
        "Ascend device ids 0..1 (agents.start_device_id 0 + agent ranks 0..1): "
        "ASCEND_RT_VISIBLE_DEVICES=4,9 makes 1 of the machine's 8 devices visible, renumbered from 0 "
        "(0 is device 4); list 2 devices there, or lower agents.start_device_id or run fewer agents",
    ]
    assert (
        "' 5' is not a device id, so the runtime reads only 4;"
        in problems("Ascend", [0], EIGHT, "4, 5", SOURCE)[0]
    )
    assert "'4' repeats a device" in problems("Ascend", [0], EIGHT, "4,4", SOURCE)[0]
    empty = problems("Ascend", [0], EIGHT, "", SOURCE)
    assert "'' is not a device id, so the runtime sees no device" in empty[0]
    assert "makes 0 of the machine's 8 devices visible, renumbered from 0 (none)" in empty[1]


def ascend_config(**agents) -> ServingConfig:
    return ServingConfig.model_validate(
        {
            "runtime": {"device_target": "Ascend", "dtype": "bfloat16"},
            "agents": {"ports": [9820, 9821], **agents},
        }
    )


def test_check_config_asks_mindspore_once_per_target_for_the_groups_run_here(monkeypatch):
    asked = []

    def fake_probe(target, environ):
        asked.append((target, environ.get("ASCEND_RT_VISIBLE_DEVICES")))
        return DeviceProbe(target, True, 2, "", "2.10.0")

    monkeypatch.setattr(preflight, "probe_in_child", fake_probe)
    assert preflight.check_config(ascend_config(), None, {}) == []
    assert preflight.check_config(ascend_config(start_device_id=1), [1], {}) == [
        "Ascend device ids 2 (agents.start_device_id 1 + agent ranks 1): the runtime sees 2 Ascend "
        "devices (0..1); lower agents.start_device_id or run fewer agents"
    ]
    assert preflight.check_config(ascend_config(), None, {"ASCEND_RT_VISIBLE_DEVICES": "1"})[0].startswith(
        "Ascend device ids 0..1 (agents.start_device_id 0 + agent ranks 0..1): ASCEND_RT_VISIBLE_DEVICES=1 "
        "makes 1 of the machine's 2 devices visible"
    )
    assert asked == [("Ascend", None), ("Ascend", None), ("Ascend", "1")]
    assert preflight.check_config(ServingConfig(), None, {}) == []  # CPU: MindSpore not asked
    assert len(asked) == 3


def test_cuda_visible_devices_by_uuid_are_left_to_the_agents_own_check():
    gpus = DeviceProbe("GPU", True, 4, "", "2.10.0")
    assert problems("GPU", [0, 1], gpus, "GPU-8f2e,GPU-11ab", SOURCE) == []
    assert (
        "CUDA_VISIBLE_DEVICES=1 makes 1 of the machine's 4 devices visible"
        in problems("GPU", [0, 1], gpus, "1", SOURCE)[0]
    )
