"""Serving benchmark: drives any server over HTTP (this project's native API or an OpenAI-compatible
one) with closed-loop concurrency sweeps or open-loop Poisson arrivals. `python -m tools.bench -h`."""
