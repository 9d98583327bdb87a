"""Scaling out on Ray Serve: LLMServer replicas across machines (python -m tools.ray_serve)."""
