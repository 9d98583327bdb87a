"""runtime.kv_tiers: off by default, bounded, its folder resolved against the project root."""

import pytest
from pydantic import ValidationError

from config.base import PROJECT_ROOT
from config.schema import RuntimeSection


def test_off_by_default():
    tiers = RuntimeSection().kv_tiers
    assert (tiers.host_mb, tiers.disk_mb, tiers.enabled) == (0, 0, False)
    assert tiers.disk_dir == PROJECT_ROOT / "output" / "kv_tiers"


def test_either_tier_turns_it_on_and_the_folder_resolves():
    tiers = RuntimeSection(kv_tiers={"disk_mb": 64, "disk_dir": "somewhere/kv"}).kv_tiers
    assert tiers.enabled and tiers.host_mb == 0
    assert tiers.disk_dir == PROJECT_ROOT / "somewhere" / "kv"
    assert RuntimeSection(kv_tiers={"host_mb": 8}).kv_tiers.enabled


@pytest.mark.parametrize(
    "bad, words",
    [
        ({"host_mb": -1}, "host_mb"),
        ({"disk_mb": 1 << 30}, "disk_mb"),
        ({"host_gb": 1}, "host_gb"),  # a misspelt key is refused, not ignored
    ],
)
def test_bad_bounds_are_refused_by_name(bad, words):
    with pytest.raises(ValidationError, match=words):
        RuntimeSection(kv_tiers=bad)
