"""Process-wide settings of every process that runs the model's graphs (the agents, and the tools and
tests that run it in-process). The process's entry calls set_process_defaults() before MindSpore or
the CPU kernels load: GLOG_v is read when MindSpore is imported, the OpenMP policy when its OpenMP
runtime starts, and spawned agents inherit both. The launcher adds device_defaults() to the
environment of the agents (and cluster schedulers) it spawns for a device target."""

import os
from collections.abc import Mapping

# What vllm-mindspore's env_setup sets for its Ascend workers; each only where the user has not.
ASCEND_DEFAULTS = {
    # seconds a collective waits for its peers: a rank still compiling a graph is not a dead one
    "HCCL_EXEC_TIMEOUT": "7200",
    # HCCL's collectives expanded on the vector cores: lower latency for decode's small all-reduces
    "HCCL_OP_EXPANSION_MODE": "AIV",
    # MindSpore's low-latency collective library off: HCCL carries every collective
    "MS_ENABLE_LCCL": "off",
    # seconds the dynamic cluster waits for a node (MindSpore's default, 15 s, times out a slow start)
    "MS_NODE_TIMEOUT": "180",
    # the device memory pool on virtual memory: it grows without fragmenting
    "MS_ALLOC_CONF": "enable_vmm:true",
}


def set_process_defaults() -> None:
    # MindSpore prints framework warnings (deprecations, compile-cache misses) to stderr at level 2;
    # keep operator consoles readable unless the user asks for them with GLOG_v=2 or lower.
    os.environ.setdefault("GLOG_v", "3")
    # OpenMP workers (MindSpore's CPU ops use libgomp) sleep between ops rather than spin on the
    # cores the kernels' own team (agent/kernels/thread_team.h) works on.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def device_defaults(device_target: str, environ: Mapping[str, str] = os.environ) -> dict[str, str]:
    """The variables a process running on `device_target` gets beyond `environ`: on Ascend, those
    of ASCEND_DEFAULTS it does not set (a user's own value wins); none elsewhere."""
    if device_target != "Ascend":
        return {}
    return {name: value for name, value in ASCEND_DEFAULTS.items() if name not in environ}
