"""The launcher's probe child (`python -m agent.launcher.preflight Ascend`, agent/launcher/preflight.py)
on this machine: the real MindSpore wheel answers what it accepts and what it has kernels for; the
CANN toolkit is a fake folder with its version file (none is installed here, so the Ascend runtime
does not load and no SoC or card memory is read)."""

from __future__ import annotations

import os

import mindspore as ms

from agent.launcher import preflight
from agent.launcher.preflight import check_config, probe_in_child
from config.schema import ServingConfig


def test_the_child_reads_the_toolkits_version_and_the_wheels_accepted_versions_and_kernels(
    tmp_path, monkeypatch
):
    toolkit = tmp_path / "ascend-toolkit" / "latest"
    (toolkit / "compiler").mkdir(parents=True)
    (toolkit / "compiler" / "version.info").write_text("Version=8.0.RC3\nversion_dir=8.0.RC3\n")
    environ = {**os.environ, "ASCEND_HOME_PATH": str(toolkit)}
    found = probe_in_child("Ascend", environ)
    assert not found.available and found.version == ms.__version__
    assert found.cann_version == "8.0"
    assert found.cann_accepted == ["8.2", "8.3", "8.5", "9.0", "9.1"]  # MindSpore 2.10's own list
    assert found.paged_socs == ["ascend310p", "ascend910b"]
    assert (found.soc, found.hbm_mb) == ("", [])  # asked only of a runtime that sees devices
    monkeypatch.setattr(preflight, "probe_in_child", lambda target, environ: found)  # asked once
    config = ServingConfig.model_validate({"runtime": {"device_target": "Ascend", "dtype": "bfloat16"}})
    lines = check_config(config, None, environ)
    assert [line.split(":")[0] for line in lines] == [
        "device_target Ascend",
        "CANN 8.0 ($ASCEND_HOME_PATH/compiler/version.info) is not a version MindSpore 2.10.0 accepts "
        "(8.2, 8.3, 8.5, 9.0, 9.1; MindSpore only warns, and GLOG_v=3 hides it)",
    ]
