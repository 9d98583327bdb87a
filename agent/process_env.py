"""Process-wide settings of every process that runs the model's graphs (the agents, and the tools and
tests that run it in-process). The process's entry calls set_process_defaults() before MindSpore or
the CPU kernels load: GLOG_v is read when MindSpore is imported, the OpenMP policy when its OpenMP
runtime starts, and spawned agents inherit both."""

import os


def set_process_defaults() -> None:
    # MindSpore prints framework warnings (deprecations, compile-cache misses) to stderr at level 2;
    # keep operator consoles readable unless the user asks for them with GLOG_v=2 or lower.
    os.environ.setdefault("GLOG_v", "3")
    # OpenMP workers (MindSpore's CPU ops use libgomp) sleep between ops rather than spin on the
    # cores the kernels' own team (agent/kernels/thread_team.h) works on.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
