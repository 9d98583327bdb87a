"""What a model's agents may plan, against what is left: the launcher refuses a load that does not fit
instead of letting the machine swap or the OOM killer pick a process.

A model needs runtime.memory_budget_mb per agent (its memory plan's whole: weights, KV blocks,
working memory; agent/memory_plan.py) times the agents this launcher runs for it. What is left is
agents.memory_limit_mb less what the loaded models need, or without a limit what the machine has
available now (the loaded models' agents already hold theirs) less what the models still loading
will take.
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
) -> str | None:
    """Why model `name` (needing `need` MB over `agents` agents) cannot load now, naming the sizes;
    None when it fits. held: the loaded and loading models' needs; loading: those still starting."""
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
    left = int(available_mb()) - sum(loading.values())
    if need > left:
        starting = f", {sum(loading.values())} MB of it for models still loading" if loading else ""
        return f"{wants}; the machine has {left} MB available{starting} ({others})"
    return None
