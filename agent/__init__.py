"""Agent side: the model, its runner and graphs, and the agent processes."""
import os

# MindSpore prints framework warnings (deprecations, compile-cache misses) to stderr at level 2;
# keep operator consoles readable unless the user asks for them with GLOG_v=2 or lower.
os.environ.setdefault("GLOG_v", "3")
# The matmul kernel's OpenMP workers must sleep between kernels, not spin on the two cores
# MindSpore's own kernel threads need (spinning cost 50 ms a step at batch 1, measured).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
