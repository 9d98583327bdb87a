"""The architecture's import rules, checked on the code as it is:

- the server, scheduler and client processes import the contract (agent.contract), the model's
  files (agent.model) and config, never MindSpore or the agent runtime, and importing them changes
  nothing in the environment; OpenTelemetry's SDK and exporter are imported only when tracing is
  configured (its API alone may be: FastAPI imports it where it is installed);
- no import cycle anywhere in the project (imports inside functions included).
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

from config.schema import PROJECT_ROOT

PACKAGES = ("agent", "scheduler", "server", "config", "client", "tools")
FRONT_END = ("server", "scheduler", "client")
SHARED = ("agent.contract", "agent.model")  # what the front end may use of agent/

PROBE = """
import importlib, json, os, pkgutil, sys
before = dict(os.environ)
for package in {packages}:
    importlib.import_module(package)
    for module in pkgutil.walk_packages(sys.modules[package].__path__, package + "."):
        importlib.import_module(module.name)
agent = sorted(m for m in sys.modules if m == "agent" or m.startswith("agent."))
print(json.dumps({{"mindspore": sorted(m for m in sys.modules if m.split(".")[0] == "mindspore"),
                  "opentelemetry": sorted(m for m in sys.modules if m.split(".")[0] == "opentelemetry"),
                  "agent": agent, "env": sorted(k for k in set(before) | set(os.environ)
                                                if before.get(k) != os.environ.get(k))}}))
"""


def test_front_end_processes_import_neither_mindspore_nor_the_agent_runtime():
    done = subprocess.run(
        [sys.executable, "-c", PROBE.format(packages=list(FRONT_END))],
        cwd=PROJECT_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert found["mindspore"] == []
    sdk = [m for m in found["opentelemetry"] if m.startswith(("opentelemetry.sdk", "opentelemetry.exporter"))]
    assert sdk == [], "tracing must cost nothing (not even its import) while it is off"
    runtime = [m for m in found["agent"] if m != "agent" and not m.startswith(SHARED)]
    assert runtime == [], f"the front end imports the agent runtime: {runtime}"
    assert found["env"] == [], f"importing the front end changed the environment: {found['env']}"


def project_modules() -> dict[str, Path]:
    modules = {}
    for package in PACKAGES:
        for path in (PROJECT_ROOT / package).rglob("*.py"):
            parts = path.relative_to(PROJECT_ROOT).with_suffix("").parts
            modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def imports_of(path: Path, module: str, modules: dict[str, Path]) -> set[str]:
    """Project modules `path` imports, at any depth of its code."""
    is_package = path.name == "__init__.py"
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name in modules}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = module.split(".")[: len(module.split(".")) - node.level + is_package]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                name = f"{base}.{alias.name}"
                found.add(name if name in modules else base)
    return {name for name in found if name in modules and name != module}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in graph[node]:
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in graph:
        if node not in index:
            visit(node)
    return found


def test_no_import_cycles():
    modules = project_modules()
    graph = {name: imports_of(path, name, modules) for name, path in modules.items()}
    assert graph["agent.model.formats"] >= {"agent.model.formats.gguf_file", "agent.model.checkpoint"}
    assert cycles(graph) == []


def test_the_cycle_check_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
