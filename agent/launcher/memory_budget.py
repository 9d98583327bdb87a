"""What a model's agents may plan, against what is left: the launcher refuses a load that does not fit
instead of letting the machine swap or the OOM killer pick a process.

A model needs runtime.memory_budget_mb per agent (its memory plan's whole: weights, KV blocks,
working memory; agent/memory_plan.py) times the agents this launcher runs for it. What is left is
agents.memory_limit_mb less what the loaded models need, or without a limit what the machine has
available now (the loaded models' agents already hold theirs) less what the models still loading
will take.

On Ascend and GPU the budget is device memory (each agent caps its device's memory pool at it:
agent/runner.py configure_mindspore), so the host's available memory says nothing of it: each of
the model's devices must hold the budget beside the other models' agents on that device, within
agents.device_memory_mb.
"""

from __future__ import annotations

import os
from pathlib import Path

from config.schema import ServingConfig

MEMINFO = Path("/proc/meminfo")


def need_mb(config: ServingConfig, agents: int) -> int | None:
    """The most a model's agents plan to hold (None: the model has no memory_budget_mb to plan with)."""
    budget = config.runtime.memory_budget_mb
    return None if budget is None else budget * agents


def available_mb() -> float:
    """The machine's available memory (Linux's MemAvailable: free plus what the page cache gives back)."""
    try:
        for line in MEMINFO.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") / (1 << 20)


def refusal(
    name: str,
    need: int | None,
    agents: int,
    limit_mb: int | None,
    held: dict[str, int],
    loading: dict[str, int],
    host: bool = True,
) -> str | None:
    """Why model `name` (needing `need` MB over `agents` agents) cannot load now, naming the sizes;
    None when it fits. held: the loaded and loading models' needs; loading: those still starting;
    host: the budget is host memory (CPU), else without a limit nothing is compared here."""
    if need is None:
        return None  # nothing planned to compare: the agent's own plan decides
    each = need // max(agents, 1)
    wants = f"model {name!r} needs {need} MB ({agents} agent(s) x {each} MB runtime.memory_budget_mb)"
    others = ", ".join(f"{model} {mb} MB" for model, mb in held.items()) or "no other model"
    if limit_mb is not None:
        left = limit_mb - sum(held.values())
        if need > left:
            return f"{wants}; {left} MB of agents.memory_limit_mb ({limit_mb} MB) is left ({others})"
        return None
    if not host:
        return None
    left = int(available_mb()) - sum(loading.values())
    if need > left:
        starting = f", {sum(loading.values())} MB of it for models still loading" if loading else ""
        return f"{wants}; the machine has {left} MB available{starting} ({others})"
    return None


def device_refusal(
    name: str,
    budget_mb: int | None,
    devices: list[int],
    device_mb: int | None,
    held: dict[str, tuple[int, list[int]]],
) -> str | None:
    """Why model `name`, whose agents each hold `budget_mb` on one of `devices`, cannot load beside
    `held` (the loaded and loading models' budget per agent and devices) on devices of `device_mb`
    each (agents.device_memory_mb); None when it fits or nothing is known to compare."""
    if budget_mb is None or device_mb is None:
        return None
    for device in devices:
        others = {model: mb for model, (mb, used) in held.items() if device in used}
        left = device_mb - sum(others.values())
        if budget_mb > left:
            beside = ", ".join(f"{model} {mb} MB" for model, mb in others.items()) or "no other model"
            return (
                f"model {name!r} needs {budget_mb} MB (runtime.memory_budget_mb) on device {device}; "
                f"{left} MB of its {device_mb} MB (agents.device_memory_mb) is left ({beside}): "
                "lower memory_budget_mb or unload a model on that device"
            )
    return None
