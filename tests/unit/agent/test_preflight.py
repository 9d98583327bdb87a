"""The Ascend/GPU preflight (agent/launcher/preflight.py): one line per problem, with its fix, from
what MindSpore reports. MindSpore's answers are mocked (DeviceProbe values, and probe_in_child in
check_config) because no NPU or CANN toolkit exists here; so are the toolkit (a folder with its
version file) and npu-smi's answers (text written after public examples of its output, never seen
from a card here). The real launcher on this machine is tests/integration/agent/test_ascend_ready.py,
its probe child tests/integration/agent/test_preflight_probe.py."""

from __future__ import annotations

import os
from dataclasses import replace

import pytest

from agent.launcher import preflight
from agent.launcher.preflight import (
    DeviceNeeds,
    DeviceProbe,
    cann_version,
    chip_ids,
    internal_kernels,
    memory_mb,
    paged_kernel_socs,
    problems,
    visible_devices,
)
from config.schema import ServingConfig

pytestmark = pytest.mark.unit
EIGHT = DeviceProbe("Ascend", True, 8, "", "2.10.0")
SOURCE = "agents.start_device_id 0 + local ranks 0..3"
ACCEPTED = ["8.2", "8.3", "8.5", "9.0", "9.1"]  # MindSpore 2.10's AscendEnvChecker.version
# An Atlas 800T A2 as the launcher's child reports it: CANN 9.1, 910B3 cards of 64 GB
HEALTHY = replace(
    EIGHT,
    cann_version="9.1",
    cann_accepted=ACCEPTED,
    soc="ascend910b",
    paged_socs=["ascend310p", "ascend910b"],
    hbm_mb=[65536] * 8,
)
SHIPPED = DeviceNeeds(paged_attention=True, device_memory_mb=65536, memory_budget_mb=58000)


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
    source = "agents.start_device_id 6 + local ranks 0..3"
    assert problems("Ascend", [6, 7, 8, 9], EIGHT, None, source) == [
        "Ascend device ids 6..9 (agents.start_device_id 6 + local ranks 0..3): the runtime sees 8 "
        "Ascend devices (0..7); lower agents.start_device_id or run fewer agents"
    ]


def test_visible_devices_renumber_from_zero():
    """ASCEND_RT_VISIBLE_DEVICES=4,5,6,7 on an 8-device machine: ids 0..3 are devices 4..7, so 4
    agents from id 0 fit and a fifth does not; CANN stops reading at the first entry that is not a
    device (a space, an id past the count, a repeat)."""
    assert visible_devices("ASCEND_RT_VISIBLE_DEVICES", "4,5,6,7", 8) == ([4, 5, 6, 7], None)
    assert problems("Ascend", [0, 1, 2, 3], EIGHT, "4,5,6,7", SOURCE) == []
    assert problems(
        "Ascend", [0, 1, 2, 3, 4], EIGHT, "4,5,6,7", "agents.start_device_id 0 + local ranks 0..4"
    ) == [
        "Ascend device ids 0..4 (agents.start_device_id 0 + local ranks 0..4): "
        "ASCEND_RT_VISIBLE_DEVICES=4,5,6,7 makes 4 of the machine's 8 devices visible, renumbered "
        "from 0 (0 is device 4, 1 is device 5, 2 is device 6, 3 is device 7); list 5 devices there, "
        "or lower agents.start_device_id or run fewer agents"
    ]
    # a physical id as start_device_id: the agents' device 4 is past the 2 visible ones
    assert "list 6 devices there" in problems("Ascend", [4, 5], EIGHT, "4,5", SOURCE)[0]


def test_a_visible_devices_list_the_runtime_cuts_short_is_a_problem():
    two = "agents.start_device_id 0 + local ranks 0..1"
    assert problems("Ascend", [0, 1], EIGHT, "4,9", two) == [
        "ASCEND_RT_VISIBLE_DEVICES=4,9: '9' is not a device of this machine (0..7), so the runtime "
        "reads only 4; list distinct device ids 0..7 separated by commas without spaces, or unset "
        "ASCEND_RT_VISIBLE_DEVICES",
        "Ascend device ids 0..1 (agents.start_device_id 0 + local ranks 0..1): "
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
        "Ascend device ids 2 (agents.start_device_id 1 + local ranks 1): the runtime sees 2 Ascend "
        "devices (0..1); lower agents.start_device_id or run fewer agents"
    ]
    assert preflight.check_config(ascend_config(), None, {"ASCEND_RT_VISIBLE_DEVICES": "1"})[0].startswith(
        "Ascend device ids 0..1 (agents.start_device_id 0 + local ranks 0..1): ASCEND_RT_VISIBLE_DEVICES=1 "
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


def test_a_healthy_910b_machine_gives_no_line():
    assert problems("Ascend", list(range(8)), HEALTHY, None, SOURCE, SHIPPED) == []
    assert problems("Ascend", [0, 1], HEALTHY, "6,7", SOURCE, SHIPPED) == []


def test_a_cann_version_the_wheel_does_not_accept_names_the_accepted_ones():
    """MindSpore 2.10 only warns of it (GLOG_v=3, the agents' default, hides the warning)."""
    old = replace(HEALTHY, cann_version="8.0")
    assert problems("Ascend", [0], old, None, SOURCE, SHIPPED) == [
        "CANN 8.0 ($ASCEND_HOME_PATH/compiler/version.info) is not a version MindSpore 2.10.0 accepts "
        "(8.2, 8.3, 8.5, 9.0, 9.1; MindSpore only warns, and GLOG_v=3 hides it): install one of those "
        "and source its set_env.sh before starting, or the MindSpore release that pairs with CANN 8.0 "
        "(mindspore.cn/install)"
    ]
    # a runtime that does not even load: both lines, the install steps first
    broken = replace(old, available=False, count=0, detail="libge_runner.so: cannot open shared object file")
    assert [line[:40] for line in problems("Ascend", [0], broken, None, SOURCE)] == [
        "device_target Ascend: MindSpore 2.10.0 c",
        "CANN 8.0 ($ASCEND_HOME_PATH/compiler/ver",
    ]
    # unknown (no version file, or a wheel that no longer lists its versions): nothing to say
    assert problems("Ascend", [0], replace(HEALTHY, cann_version=""), None, SOURCE) == []
    assert problems("Ascend", [0], replace(old, cann_accepted=[]), None, SOURCE) == []


def test_the_cann_version_is_read_as_mindspore_reads_it(tmp_path, monkeypatch):
    """The first two numbers of the `Version=` line of $ASCEND_HOME_PATH/compiler/version.info
    (mindspore.run_check._check_version); a fake toolkit folder stands in for CANN."""
    toolkit = tmp_path / "ascend-toolkit" / "latest"
    (toolkit / "compiler").mkdir(parents=True)
    (toolkit / "compiler" / "version.info").write_text(
        "Version=8.3.RC1\nversion_dir=8.3.RC1\ntimestamp=20250901_000000000\n"
    )
    monkeypatch.setenv("ASCEND_HOME_PATH", str(toolkit))
    assert cann_version(os.environ) == "8.3"
    (toolkit / "compiler" / "version.info").write_text("Version=9.1.0\n")
    assert cann_version(os.environ) == "9.1"
    assert cann_version({"ASCEND_HOME_PATH": str(tmp_path / "absent")}) == ""
    assert cann_version({}) == ""  # set_env.sh not sourced: MindSpore skips its check as well


def test_paged_attention_on_a_soc_without_its_kernels_is_named_with_the_way_out():
    a3 = replace(HEALTHY, soc="ascend910_93")
    assert problems("Ascend", [0], a3, None, SOURCE, SHIPPED) == [
        "runtime.decode_attention paged (Ascend's default) runs MindSpore's PagedAttention and "
        "ReshapeAndCache kernels, which MindSpore 2.10.0 has for ascend310p, ascend910b only, not this "
        "machine's ascend910_93: run on 910B (Ascend910B1..B4) or 310P cards, or set "
        "runtime.decode_attention: gather"
    ]
    gather = replace(SHIPPED, paged_attention=False)
    assert problems("Ascend", [0], a3, None, SOURCE, gather) == []
    assert problems("Ascend", [0], replace(HEALTHY, soc="ascend310p"), None, SOURCE, SHIPPED) == []
    assert problems("Ascend", [0], replace(a3, soc=""), None, SOURCE, SHIPPED) == []  # not told


def test_the_wheels_paged_kernels_exist_for_910b_and_310p_only(tmp_path):
    """Read from the installed wheel's folders (found without importing MindSpore), and from a
    fake one: a SoC needs both kernels."""
    assert paged_kernel_socs(internal_kernels()) == ["ascend310p", "ascend910b"]
    for soc, files in {
        "ascend910b": ["object_kernels/paged_attention_v2/paged_attention_v2.o", "libreshape_and_cache.so"],
        "ascend910_93": ["libreshape_and_cache.so"],
        "ascend950": ["libmatmul.so"],
    }.items():
        for name in files:
            (tmp_path / soc / name).parent.mkdir(parents=True, exist_ok=True)
            (tmp_path / soc / name).touch()
    assert paged_kernel_socs(tmp_path) == ["ascend910b"]
    assert paged_kernel_socs(tmp_path / "absent") == paged_kernel_socs(None) == []


def test_cards_smaller_than_the_configured_memory_are_named_with_their_size():
    """A 910B4 has 32 GB where the shipped configs say 64 GB: both settings named with the size."""
    b4 = replace(HEALTHY, hbm_mb=[32768] * 8)
    assert problems("Ascend", list(range(8)), b4, None, SOURCE, SHIPPED) == [
        "agents.device_memory_mb 65536 is more than Ascend devices 0..7 (32768 MB each, npu-smi): set "
        "agents.device_memory_mb: 32768",
        "runtime.memory_budget_mb 58000 does not fit Ascend devices 0..7 (32768 MB each, npu-smi): lower "
        "it below 32768, leaving CANN its workspace, or run on cards with more memory",
    ]
    fits = DeviceNeeds(paged_attention=True, device_memory_mb=32768, memory_budget_mb=28000)
    assert problems("Ascend", list(range(8)), b4, None, SOURCE, fits) == []
    # the visible-devices variable picks the machine's cards: here the two 32 GB ones, 6 and 7
    mixed = replace(HEALTHY, hbm_mb=[65536] * 6 + [32768, 32768])
    assert problems("Ascend", [0, 1], mixed, "0,1", SOURCE, SHIPPED) == []
    assert problems("Ascend", [1], mixed, "5,6", SOURCE, SHIPPED)[0] == (
        "agents.device_memory_mb 65536 is more than Ascend device 1 (32768 MB, npu-smi): set "
        "agents.device_memory_mb: 32768"
    )
    unread = replace(HEALTHY, hbm_mb=[None] * 8)
    assert problems("Ascend", [0], unread, None, SOURCE, SHIPPED) == []
    assert problems("Ascend", [0], replace(HEALTHY, hbm_mb=[]), None, SOURCE, SHIPPED) == []


def test_npu_smi_tables_give_each_devices_chip_and_memory():
    mapping = """
        NPU ID        Chip ID        Chip Logic ID        Chip Name
        0             0              0                    Ascend 910B4
        0             1              -                    Mcu
        1             0              1                    Ascend 910B4
        1             1              -                    Mcu
    """
    assert chip_ids(mapping) == {0: (0, 0), 1: (1, 0)}
    # an A3 board: two chips an NPU, a Chip Phy ID column before the name
    a3 = (
        "NPU ID  Chip ID  Chip Logic ID  Chip Phy ID  Chip Name\n0  0  0  0  Ascend910\n0  1  1  1  Ascend910"
    )
    assert chip_ids(a3) == {0: (0, 0), 1: (0, 1)}
    report = """
        NPU ID                         : 0
        Chip Count                     : 1

        DDR Capacity(MB)               : 0
        DDR Clock Speed(MHz)           : 0
        DDR Usage Rate(%)              : 0
        HBM Capacity(MB)               : 32768
        HBM Clock Speed(MHz)           : 1600
        HBM Usage Rate(%)              : 0
        Chip ID                        : 0
    """
    assert memory_mb(report) == 32768
    assert memory_mb("DDR Capacity(MB) : 44280\nDDR Usage Rate(%) : 3") == 44280  # a 310P: DDR
    assert memory_mb("") is None and chip_ids("") == {}


def test_the_child_reads_each_cards_memory_through_npu_smi(monkeypatch):
    """npu-smi mocked (none here): one mapping query, then one memory query per chip."""
    answers = {
        ("info", "-m"): "NPU ID Chip ID Chip Logic ID Chip Name\n0 0 0 Ascend 910B4\n1 0 1 Ascend 910B4\n",
        ("info", "-t", "memory", "-i", "0", "-c", "0"): "HBM Capacity(MB) : 32768\n",
        ("info", "-t", "memory", "-i", "1", "-c", "0"): "",  # an answer npu-smi did not give
    }
    monkeypatch.setattr(preflight, "_npu_smi", lambda *args: answers[args])
    assert preflight.device_memory_mb() == [32768, None]
    monkeypatch.setattr(preflight, "_npu_smi", lambda *args: "")  # no npu-smi
    assert preflight.device_memory_mb() == []


def test_check_config_holds_each_models_cards_to_its_own_settings(monkeypatch):
    monkeypatch.setattr(
        preflight, "probe_in_child", lambda target, environ: replace(HEALTHY, hbm_mb=[32768] * 8)
    )
    config = ascend_config(device_memory_mb=65536)
    assert preflight.check_config(config, None, {}) == [
        "agents.device_memory_mb 65536 is more than Ascend devices 0..1 (32768 MB each, npu-smi): set "
        "agents.device_memory_mb: 32768"
    ]
    gather = config.model_copy(
        update={"runtime": config.runtime.model_copy(update={"decode_attention": "gather"})}
    )
    monkeypatch.setattr(
        preflight, "probe_in_child", lambda target, environ: replace(HEALTHY, soc="ascend910_93")
    )
    assert preflight.check_config(config, None, {})[0].startswith("runtime.decode_attention paged")
    assert preflight.check_config(gather, None, {}) == []


def test_each_host_counts_its_agents_devices_from_start_device_id(monkeypatch):
    """Two hosts of 8 cards, a tensor-parallel group of 8 on each: every agent on devices 0..7 of its
    own host (a global rank would put the second host's on 8..15)."""
    monkeypatch.setattr(preflight, "probe_in_child", lambda target, environ: HEALTHY)
    keys = {"public_key": "k" * 40, "secret_key": "s" * 40}
    groups = [
        {"ports": list(range(first, first + 8)), "cluster_port": first + 100, "host": host}
        for first, host in ((9820, "10.0.0.1"), (9840, "10.0.0.2"))
    ]
    config = ServingConfig.model_validate(
        {
            "runtime": {"device_target": "Ascend", "dtype": "bfloat16"},
            "agents": {
                "groups": groups,
                "curve": {"server_public_key": "p" * 40, "agents": [keys] * 16},
            },
        }
    )
    assert [config.agents.device_id(rank) for rank in range(16)] == list(range(8)) * 2
    assert preflight.check_config(config, [1], {}) == []  # the second host's launcher: devices 0..7
    short = replace(HEALTHY, count=4, hbm_mb=[65536] * 4)
    monkeypatch.setattr(preflight, "probe_in_child", lambda target, environ: short)
    assert preflight.check_config(config, [1], {}) == [
        "Ascend device ids 0..7 (agents.start_device_id 0 + local ranks 0..7): the runtime sees 4 "
        "Ascend devices (0..3); lower agents.start_device_id or run fewer agents"
    ]
