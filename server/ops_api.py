"""Operations endpoints: liveness, readiness, server facts, Prometheus metrics.

GET /health    200 while the process serves HTTP
GET /ready     200 when every agent answers a ping and the server admits requests; else 503 and why
GET /info      model, limits, slots, version (TGI-style)
GET /metrics   Prometheus text format
GET /dashboard a self-contained live page (batch size, queue, tokens/s, TTFT, agent health)
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from fastapi import APIRouter
from fastapi.responses import HTMLResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from config.schema import ServingConfig
from scheduler.engine import Engine
from server.errors import ApiError

DASHBOARD = Path(__file__).with_name("static") / "dashboard.html"


def package_version() -> str:
    try:
        return version("ms-llm-serving")
    except PackageNotFoundError:
        return "unknown"


def ops_router(config: ServingConfig, engine: Engine) -> APIRouter:
    router = APIRouter()

    @router.get("/health")
    async def health():
        return {"status": "ok"}

    @router.get("/ready")
    async def ready():
        reason = await engine.readiness()
        if reason:
            raise ApiError(503, f"not ready: {reason}")
        return {"status": "ready"}

    @router.get("/info")
    async def info():
        return {
            "model_id": config.model.name,
            "aliases": config.model.aliases,
            "version": package_version(),
            "max_input_length": min((c.max_prompt_len for c in engine.capacities), default=None),
            "max_total_tokens": min((c.max_seq_len for c in engine.capacities), default=None),
            "slots": sum(c.seats for c in engine.capacities if c.decodes),
            "agents": [a for c in engine.clients for a in c.address.split(",")],
            "groups": [
                {
                    "group": i,
                    "role": config.agents.groups[i].role,
                    "agents": client.address.split(","),
                    "slots": engine.group_slots(i),
                    "running": engine.get_bs_current(i),
                    "kv_blocks": engine.group_blocks(i),
                }
                for i, client in enumerate(engine.clients)
            ],
            "max_waiting_requests": config.server.max_waiting_requests,
        }

    @router.get("/metrics")
    async def metrics():
        return Response(generate_latest(engine.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @router.get("/dashboard")
    async def dashboard():
        return HTMLResponse(DASHBOARD.read_text(encoding="utf-8"))

    return router
