"""Preflight of a non-CPU target (Ascend, GPU) before any agent starts: MindSpore's runtime for the
target is present, it sees devices, and every agent's device id (agents.start_device_id + rank)
names a visible one once ASCEND_RT_VISIBLE_DEVICES (CUDA_VISIBLE_DEVICES) is applied. One line per
problem, each naming its fix: a missing CANN toolkit or a wrong device count stops the launcher in
seconds instead of surfacing as a traceback deep in an agent.

The launcher asks MindSpore in a child process (`python -m agent.launcher.preflight TARGET`), with
the visible-devices variable removed so that the runtime counts every device of the machine: the
launcher itself stays free of MindSpore (~400 MB) and of a device context, and the variable is
applied here as the runtime applies it (CANN's documentation: the listed ids, in their order, become
0..N-1; reading stops at the first entry that is not a device id). The agent checks its own device
again in-process before MindSpore touches it (require_device: tools that run the model go through
it too).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import asdict, dataclass

from config.schema import PROJECT_ROOT, ServingConfig

VISIBLE_ENV = {"Ascend": "ASCEND_RT_VISIBLE_DEVICES", "GPU": "CUDA_VISIBLE_DEVICES"}
INSTALL = {
    "Ascend": "install the CANN toolkit and MindSpore's Ascend wheel, then `source "
    "/usr/local/Ascend/ascend-toolkit/set_env.sh` before starting (README: On Ascend)",
    "GPU": "install CUDA and MindSpore's GPU wheel",
}
LIST_DEVICES = {"Ascend": "`npu-smi info` lists the NPUs", "GPU": "`nvidia-smi` lists the GPUs"}
PROBE_TIMEOUT_S = 300  # importing MindSpore and initialising a driver; far less on a healthy machine


class DeviceUnavailable(RuntimeError):
    """The configured device cannot be used; the message has one line per problem, with its fix."""


@dataclass(frozen=True)
class DeviceProbe:
    """What MindSpore says of a target: its runtime loaded, the devices it sees (None: counting
    failed), why not (`detail`)."""

    target: str
    available: bool
    count: int | None = 0
    detail: str = ""
    version: str = ""


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


def probe_in_child(target: str, environ: Mapping[str, str] = os.environ) -> DeviceProbe:
    """probe() in a child process that sees every device (the visible-devices variable removed)."""
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
    target: str, device_ids: list[int], found: DeviceProbe, env_value: str | None, source: str
) -> list[str]:
    """One line per reason the agents cannot run on `device_ids` (`source`: where the ids come
    from), each with its fix; `env_value`: the visible-devices variable, None when unset."""
    if not found.available:
        why = found.detail or f"this build has no {target} support"
        return [
            f"device_target {target}: MindSpore {found.version} cannot use {target} devices ({why}): "
            f"{INSTALL[target]}; or set runtime.device_target: CPU"
        ]
    if found.count is None:
        return [
            f"device_target {target}: MindSpore's {target} runtime loaded but could not count the devices "
            f"({found.detail}): check the driver ({LIST_DEVICES[target]})"
        ]
    if found.count == 0:
        driver = f"check the driver ({LIST_DEVICES[target]})"
        return [f"device_target {target}: the {target} runtime sees no device: {driver}"]
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
        return lines
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
    return lines


def _span(ids: list[int]) -> str:
    return f"{min(ids)}..{max(ids)}" if len(ids) > 1 else str(ids[0])


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
        ids = [agents.start_device_id + r for r in ranks]
        source = f"agents.start_device_id {agents.start_device_id} + agent ranks {_span(ranks)}"
        prefix = f"model {name}: " if len(models) > 1 else ""
        env_value = environ.get(VISIBLE_ENV[target])
        found_lines = problems(target, ids, found[target], env_value, source)
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
    print(json.dumps(asdict(probe(sys.argv[1]))))
