"""Preflight of a non-CPU target (Ascend, GPU) before any agent starts: MindSpore's runtime for the
target is present, it sees devices, and every agent's device id (agents.device_id: start_device_id +
its rank among its host's agents) names a visible one once ASCEND_RT_VISIBLE_DEVICES
(CUDA_VISIBLE_DEVICES) is applied. On Ascend also what the wheel was built for and what the cards
hold: the CANN version among those the wheel accepts (MindSpore itself only warns, and GLOG_v=3
hides the warning), the SoC among those its paged-attention kernels exist for (when the model runs
them), each card's memory against agents.device_memory_mb and runtime.memory_budget_mb. One line
per problem, each naming its fix: a missing CANN toolkit, a wrong device count or a 32 GB card
configured as a 64 GB one stops the launcher in seconds instead of surfacing as a traceback deep in
an agent.

The launcher asks MindSpore in a child process (`python -m agent.launcher.preflight TARGET`), with
the visible-devices variable removed so that the runtime counts every device of the machine: the
launcher itself stays free of MindSpore (~400 MB) and of a device context, and the variable is
applied here as the runtime applies it (CANN's documentation: the listed ids, in their order, become
0..N-1; reading stops at the first entry that is not a device id). The agent checks its own device
again in-process before MindSpore touches it (require_device: tools that run the model go through
it too).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import KW_ONLY, asdict, dataclass, field, replace
from pathlib import Path

from config.schema import PROJECT_ROOT, ServingConfig

VISIBLE_ENV = {"Ascend": "ASCEND_RT_VISIBLE_DEVICES", "GPU": "CUDA_VISIBLE_DEVICES"}
INSTALL = {
    "Ascend": "install the CANN toolkit and MindSpore's Ascend wheel, then `source "
    "/usr/local/Ascend/ascend-toolkit/set_env.sh` before starting (README: On Ascend)",
    "GPU": "install CUDA and MindSpore's GPU wheel",
}
LIST_DEVICES = {"Ascend": "`npu-smi info` lists the NPUs", "GPU": "`nvidia-smi` lists the GPUs"}
PROBE_TIMEOUT_S = 300  # importing MindSpore and initialising a driver; far less on a healthy machine
NPU_SMI_TIMEOUT_S = 20  # one npu-smi query; well under a second on a healthy machine
# In the wheel: MindSpore's internal kernels (PagedAttention, ReshapeAndCache), a folder per SoC
INTERNAL_KERNELS = Path("lib/plugin/ascend/ms_kernels_internal/internal_kernel/op_kernels")
PAGED_KERNELS = ("paged_attention", "reshape_and_cache")  # in their file names, per SoC folder


class DeviceUnavailable(RuntimeError):
    """The configured device cannot be used; the message has one line per problem, with its fix."""


@dataclass(frozen=True)
class DeviceProbe:
    """What MindSpore says of a target: its runtime loaded, the devices it sees (None: counting
    failed), why not (`detail`). On Ascend the launcher's child adds (probe_machine; "" or empty:
    not known) the CANN version found and those the wheel accepts, the SoC as MindSpore names it
    (its family: ascend910b) and those the wheel has paged attention's kernels for, and each
    device's memory in MB by device id (None: not read)."""

    target: str
    available: bool
    count: int | None = 0
    detail: str = ""
    version: str = ""
    _: KW_ONLY
    cann_version: str = ""
    cann_accepted: list[str] = field(default_factory=list)
    soc: str = ""
    paged_socs: list[str] = field(default_factory=list)
    hbm_mb: list[int | None] = field(default_factory=list)


@dataclass(frozen=True, kw_only=True)
class DeviceNeeds:
    """What a model's agents need of each device beyond its presence: paged attention's kernels,
    the card's memory as configured (agents.device_memory_mb) and each agent's plan
    (runtime.memory_budget_mb)."""

    paged_attention: bool = False
    device_memory_mb: int | None = None
    memory_budget_mb: int | None = None

    @classmethod
    def of(cls, config: ServingConfig) -> DeviceNeeds:
        return cls(
            paged_attention=config.runtime.paged_attention,
            device_memory_mb=config.agents.device_memory_mb,
            memory_budget_mb=config.runtime.memory_budget_mb,
        )


def probe(target: str) -> DeviceProbe:
    """Ask MindSpore in this process (it imports MindSpore; the launcher uses probe_in_child)."""
    import mindspore as ms
    from mindspore import device_context
    from mindspore._c_expression import MSContext  # the one place that keeps why a plugin failed

    device = device_context.ascend if target == "Ascend" else device_context.gpu
    if not device.is_available():
        why = MSContext.get_instance().load_plugin_error().strip().replace("\n", "; ")
        return DeviceProbe(target, False, 0, why, ms.__version__)
    try:
        return DeviceProbe(target, True, int(device.device_count()), "", ms.__version__)
    except Exception as exc:  # a driver that loads but does not answer: the probe's finding
        return DeviceProbe(target, True, None, f"{type(exc).__name__}: {exc}", ms.__version__)


def probe_machine(target: str, environ: Mapping[str, str] = os.environ) -> DeviceProbe:
    """probe() and, on Ascend, what the toolkit, the wheel and the cards say: the launcher's child."""
    found = probe(target)
    if target != "Ascend":
        return found
    sees_devices = found.available and bool(found.count)
    return replace(
        found,
        cann_version=cann_version(environ),
        cann_accepted=accepted_cann_versions(),
        soc=ascend_soc() if sees_devices else "",
        paged_socs=paged_kernel_socs(internal_kernels()),
        hbm_mb=device_memory_mb() if sees_devices else [],
    )


def cann_version(environ: Mapping[str, str]) -> str:
    """The CANN version as MindSpore reads it at import: the first two numbers of the `Version=`
    line of $ASCEND_HOME_PATH/compiler/version.info ("8.3"); "" without that file (MindSpore then
    skips its own check too)."""
    home = environ.get("ASCEND_HOME_PATH")
    if not home:
        return ""
    try:
        lines = (Path(home) / "compiler" / "version.info").read_text(encoding="utf-8").splitlines()
    except OSError:
        return ""
    for line in lines:
        if line.startswith("Version="):
            return ".".join(line.strip().split("=", 1)[1].split(".")[:2])
    return ""


def accepted_cann_versions() -> list[str]:
    """The CANN versions the installed wheel accepts, from its own check at import
    (mindspore.run_check._check_version, AscendEnvChecker.version). A wheel that stops keeping
    them there gives []: nothing is checked, rather than a list kept here that a new wheel outdates."""
    try:
        from mindspore.run_check._check_version import AscendEnvChecker

        return [str(version) for version in AscendEnvChecker(None).version]
    except (ImportError, AttributeError, TypeError):
        return []


def ascend_soc() -> str:
    """The SoC as MindSpore names it when it picks kernels (aclrtGetSocName's Ascend910B3 mapped to
    its family, ascend910b); "" when MindSpore cannot tell."""
    from mindspore._c_expression import MSContext

    try:
        return MSContext.get_instance().get_ascend_soc_version()
    except (AttributeError, RuntimeError):
        return ""


def internal_kernels() -> Path | None:
    """The wheel's folder of internal kernels (a subfolder per SoC), found without importing MindSpore."""
    spec = importlib.util.find_spec("mindspore")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(spec.submodule_search_locations[0]) / INTERNAL_KERNELS


def paged_kernel_socs(folder: Path | None) -> list[str]:
    """The SoCs whose folder of internal kernels holds both of paged attention's (MindSpore 2.10:
    ascend310p and ascend910b; none for ascend910_93, the A3, or ascend910, the 910A/ProB)."""
    if folder is None or not folder.is_dir():
        return []
    return sorted(
        soc.name
        for soc in folder.iterdir()
        if soc.is_dir() and all(any(k in f.name for f in soc.rglob("*")) for k in PAGED_KERNELS)
    )


def device_memory_mb() -> list[int | None]:
    """Each device's memory in MB by device id before ASCEND_RT_VISIBLE_DEVICES (npu-smi's Chip
    Logic ID; None: npu-smi did not tell). MindSpore tells a device's total memory only once the
    device is initialised (mindspore.hal.get_device_properties), which takes a context on each."""
    chips = chip_ids(_npu_smi("info", "-m"))
    sizes: list[int | None] = [None] * (max(chips) + 1 if chips else 0)
    for device, (npu, chip) in chips.items():
        sizes[device] = memory_mb(_npu_smi("info", "-t", "memory", "-i", str(npu), "-c", str(chip)))
    return sizes


def chip_ids(table: str) -> dict[int, tuple[int, int]]:
    """`npu-smi info -m`'s rows: device id (Chip Logic ID) -> (NPU ID, Chip ID), for the chips that
    have one (a board's Mcu rows show "-")."""
    chips = {}
    for line in table.splitlines():
        cells = line.split()
        if len(cells) >= 3 and all(cell.isdigit() for cell in cells[:3]):
            chips[int(cells[2])] = (int(cells[0]), int(cells[1]))
    return chips


def memory_mb(report: str) -> int | None:
    """`npu-smi info -t memory -i N -c C`: the chip's `HBM Capacity(MB)`, else its DDR's (a 310P)."""
    sizes = {}
    for line in report.splitlines():
        key, colon, value = line.partition(":")
        if colon and value.strip().isdigit():
            sizes[key.strip()] = int(value.strip())
    return sizes.get("HBM Capacity(MB)") or sizes.get("DDR Capacity(MB)") or None


def _npu_smi(*args: str) -> str:
    """npu-smi's answer; "" when it is missing, fails or does not answer."""
    try:
        done = subprocess.run(["npu-smi", *args], capture_output=True, text=True, timeout=NPU_SMI_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return done.stdout if done.returncode == 0 else ""


def probe_in_child(target: str, environ: Mapping[str, str] = os.environ) -> DeviceProbe:
    """probe_machine() in a child process that sees every device (the visible-devices variable
    removed)."""
    env = {k: v for k, v in environ.items() if k != VISIBLE_ENV[target]}
    try:
        done = subprocess.run(
            [sys.executable, "-m", "agent.launcher.preflight", target],
            env=env,
            cwd=PROJECT_ROOT,
            capture_output=True,
            text=True,
            timeout=PROBE_TIMEOUT_S,
        )
    except subprocess.TimeoutExpired:
        return DeviceProbe(target, False, detail=f"MindSpore did not answer within {PROBE_TIMEOUT_S}s")
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return DeviceProbe(
            target, False, detail=f"importing MindSpore failed (exit {done.returncode}): {tail}"
        )
    return DeviceProbe(**json.loads(lines[-1]))


def visible_devices(name: str, value: str, count: int) -> tuple[list[int], str | None]:
    """The devices a visible-devices variable leaves, as the runtime reads it (up to its first entry
    that is not a distinct device id below `count`), and the problem when it stops early."""
    ids: list[int] = []
    for entry in value.split(","):
        why = _not_a_device(entry, ids, count)
        if why is not None:
            read = f"reads only {','.join(map(str, ids))}" if ids else "sees no device"
            return ids, (
                f"{name}={value}: {why}, so the runtime {read}; list distinct device ids "
                f"0..{count - 1} separated by commas without spaces, or unset {name}"
            )
        ids.append(int(entry))
    return ids, None


def _not_a_device(entry: str, taken: list[int], count: int) -> str | None:
    if not entry.isdigit():
        return f"{entry!r} is not a device id"
    if int(entry) >= count:
        return f"{entry!r} is not a device of this machine (0..{count - 1})"
    return f"{entry!r} repeats a device" if int(entry) in taken else None


def problems(
    target: str,
    device_ids: list[int],
    found: DeviceProbe,
    env_value: str | None,
    source: str,
    needs: DeviceNeeds = DeviceNeeds(),
) -> list[str]:
    """One line per reason the agents cannot run on `device_ids` (`source`: where the ids come
    from), each with its fix; `env_value`: the visible-devices variable, None when unset; `needs`:
    what the model asks of each device."""
    visible, lines = _device_problems(target, device_ids, found, env_value, source)
    return (
        lines
        + _cann_problems(found)
        + _soc_problems(found, needs)
        + _memory_problems(target, device_ids, visible, found, needs)
    )


def _device_problems(
    target: str, device_ids: list[int], found: DeviceProbe, env_value: str | None, source: str
) -> tuple[list[int], list[str]]:
    """The machine's devices the runtime sees as 0..N-1, and the problems of the runtime, the
    visible-devices variable and the agents' ids."""
    if not found.available:
        why = found.detail or f"this build has no {target} support"
        return [], [
            f"device_target {target}: MindSpore {found.version} cannot use {target} devices ({why}): "
            f"{INSTALL[target]}; or set runtime.device_target: CPU"
        ]
    if found.count is None:
        return [], [
            f"device_target {target}: MindSpore's {target} runtime loaded but could not count the devices "
            f"({found.detail}): check the driver ({LIST_DEVICES[target]})"
        ]
    if found.count == 0:
        driver = f"check the driver ({LIST_DEVICES[target]})"
        return [], [f"device_target {target}: the {target} runtime sees no device: {driver}"]
    lines = []
    name = VISIBLE_ENV[target]
    visible = list(range(found.count))
    if target == "GPU" and env_value is not None and not env_value.replace(",", "").isdigit():
        env_value = None  # CUDA also takes GPU UUIDs: the agent's own check counts what it sees
    if env_value is not None:
        visible, problem = visible_devices(name, env_value, found.count)
        lines += [problem] if problem else []
    missing = [d for d in device_ids if d >= len(visible)]
    if not missing:
        return visible, lines
    wanted = f"{target} device ids {_span(device_ids)} ({source})"
    fewer = "lower agents.start_device_id or run fewer agents"
    if env_value is None:
        seen = f"the runtime sees {found.count} {target} devices (0..{found.count - 1})"
        lines.append(f"{wanted}: {seen}; {fewer}")
    else:
        renumbered = ", ".join(f"{i} is device {d}" for i, d in enumerate(visible)) or "none"
        lines.append(
            f"{wanted}: {name}={env_value} makes {len(visible)} of the machine's {found.count} devices "
            f"visible, renumbered from 0 ({renumbered}); list {max(device_ids) + 1} devices there, "
            f"or {fewer}"
        )
    return visible, lines


def _cann_problems(found: DeviceProbe) -> list[str]:
    if not found.cann_version or not found.cann_accepted or found.cann_version in found.cann_accepted:
        return []
    return [
        f"CANN {found.cann_version} ($ASCEND_HOME_PATH/compiler/version.info) is not a version "
        f"MindSpore {found.version} accepts ({', '.join(found.cann_accepted)}; MindSpore only warns, "
        f"and GLOG_v=3 hides it): install one of those and source its set_env.sh before starting, "
        f"or the MindSpore release that pairs with CANN {found.cann_version} (mindspore.cn/install)"
    ]


def _soc_problems(found: DeviceProbe, needs: DeviceNeeds) -> list[str]:
    if not (needs.paged_attention and found.soc and found.paged_socs) or found.soc in found.paged_socs:
        return []
    return [
        f"runtime.decode_attention paged (Ascend's default) runs MindSpore's PagedAttention and "
        f"ReshapeAndCache kernels, which MindSpore {found.version} has for {', '.join(found.paged_socs)} "
        f"only, not this machine's {found.soc}: run on 910B (Ascend910B1..B4) or 310P cards, or set "
        f"runtime.decode_attention: gather"
    ]


def _memory_problems(
    target: str, device_ids: list[int], visible: list[int], found: DeviceProbe, needs: DeviceNeeds
) -> list[str]:
    """The configured sizes each agent's card does not hold, its cards named by their memory."""
    devices_of: dict[int, list[int]] = {}  # MB -> the agents' devices (as the runtime numbers them)
    for device in sorted(set(device_ids)):
        if device >= len(visible):
            continue  # the device-id line names it
        machine_id = visible[device]  # npu-smi numbers the machine's devices
        size = found.hbm_mb[machine_id] if machine_id < len(found.hbm_mb) else None
        if size is not None:
            devices_of.setdefault(size, []).append(device)
    lines = []
    for size, devices in sorted(devices_of.items()):
        each = " each" if len(devices) > 1 else ""
        cards = f"{target} device{'s' if each else ''} {_span(devices)} ({size} MB{each}, npu-smi)"
        if needs.device_memory_mb is not None and size < needs.device_memory_mb:
            lines.append(
                f"agents.device_memory_mb {needs.device_memory_mb} is more than {cards}: set "
                f"agents.device_memory_mb: {size}"
            )
        if needs.memory_budget_mb is not None and size < needs.memory_budget_mb:
            lines.append(
                f"runtime.memory_budget_mb {needs.memory_budget_mb} does not fit {cards}: lower it "
                f"below {size}, leaving CANN its workspace, or run on cards with more memory"
            )
    return lines


def _span(ids: list[int]) -> str:
    """The ids as a range where they are one (0..7), else listed (0,2)."""
    ids = sorted(set(ids))
    if len(ids) > 1 and ids == list(range(ids[0], ids[-1] + 1)):
        return f"{ids[0]}..{ids[-1]}"
    return ",".join(map(str, ids))


def check_config(
    config: ServingConfig, groups: list[int] | None, environ: Mapping[str, str] = os.environ
) -> list[str]:
    """The problems of every model in `config` on a non-CPU target (the agent groups `groups` of
    it, None: all), MindSpore asked once per target; [] when there is nothing to check."""
    found: dict[str, DeviceProbe] = {}
    lines: list[str] = []
    models = config.model_configs()
    for name, model in models.items():
        target, agents = model.runtime.device_target, model.agents
        if target == "CPU":
            continue
        ranks = [r for r, g in enumerate(agents.group_of_rank) if groups is None or g in groups]
        if not ranks:
            continue  # unknown groups: the launcher names them
        if target not in found:
            found[target] = probe_in_child(target, environ)
        ids = [agents.device_id(r) for r in ranks]
        local = _span([agents.local_rank(r) for r in ranks])
        source = f"agents.start_device_id {agents.start_device_id} + local ranks {local}"
        prefix = f"model {name}: " if len(models) > 1 else ""
        env_value = environ.get(VISIBLE_ENV[target])
        found_lines = problems(target, ids, found[target], env_value, source, DeviceNeeds.of(model))
        lines += [prefix + line for line in found_lines if prefix + line not in lines]
    return lines


def require_device(target: str, device_id: int) -> None:
    """In the agent, before MindSpore uses the device: DeviceUnavailable naming the problems. The
    runtime here has applied the visible-devices variable, so its count is of the visible ones."""
    found = probe(target)
    lines = problems(target, [device_id], found, None, "agents.start_device_id + this agent's rank")
    if lines:
        raise DeviceUnavailable("\n".join(lines))


if __name__ == "__main__":  # the launcher's probe_in_child
    print(json.dumps(asdict(probe_machine(sys.argv[1]))))
