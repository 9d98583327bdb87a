"""The contracts between processes: scheduler <-> agents (protocol, transport, sampling parameters)
and client <-> server (the native request body). No MindSpore, no side effects."""
