"""Operations endpoints: liveness, readiness, server facts, Prometheus metrics.

GET /health    200 while the process serves HTTP
GET /ready     200 when every loaded model's agents answer a ping and the server admits requests;
               else 503 and why
GET /info      the first model's facts (TGI-style: limits, slots, version) and every model's, with
               its state
GET /metrics   Prometheus text format, each sample labelled with its model
GET /dashboard a self-contained live page (batch size, queue, tokens/s, TTFT, models, agent health)
POST /reset_prefix_cache[?model=M]  forget the model's cached prefixes, in the KV pool and in its
               second tier (host memory and disk; vLLM's name): what was dropped
"""

from __future__ import annotations

from dataclasses import asdict
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from fastapi import APIRouter, Query
from fastapi.responses import HTMLResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from config.schema import ServingConfig
from scheduler.agent_client import AgentError
from server.errors import NATIVE, ApiError, declares
from server.model_repository import ModelRepository, ServedModel

DASHBOARD = Path(__file__).with_name("static") / "dashboard.html"


def package_version() -> str:
    try:
        return version("ms-llm-serving")
    except PackageNotFoundError:
        return "unknown"


def model_info(model: ServedModel) -> dict:
    """One model's facts: its names, state, limits and groups (limits and groups while loaded)."""
    config, engine = model.config, model.loaded.engine if model.loaded is not None else None
    stats = engine.stats() if engine is not None else None
    connected = stats.groups if stats is not None and stats.started else ()
    return {
        "model_id": model.name,
        "aliases": config.model.aliases,
        "state": model.state,
        "reason": model.reason,
        "max_input_length": min((g.max_prompt_len for g in connected), default=None),
        "max_total_tokens": min((g.max_seq_len for g in connected), default=None),
        "slots": stats.usable_slots if stats is not None else 0,
        "agents": [a for g in stats.groups for a in g.agents] if stats is not None else [],
        "groups": [
            {
                "group": g.group,
                "role": g.role,
                "agents": list(g.agents),
                "slots": g.slots,
                "running": g.running,
                # slot releases the group's agent has not answered yet (0: every freed slot is free there)
                "releases_pending": g.releases_pending,
                "kv_blocks": None if g.kv_blocks is None else asdict(g.kv_blocks),
                "state_snapshots": None if g.states is None else asdict(g.states),
            }
            for g in (stats.groups if stats is not None else ())
        ],
    }


def ops_router(config: ServingConfig, repository: ModelRepository) -> APIRouter:
    router = APIRouter(dependencies=[declares(NATIVE)])

    @router.get("/health")
    async def health():
        return {"status": "ok"}

    @router.get("/ready")
    async def ready():
        reason = await repository.readiness()
        if reason:
            raise ApiError(503, f"not ready: {reason}")
        return {"status": "ready"}

    @router.get("/info")
    async def info():
        models = [model_info(m) for m in repository.models.values()]
        first = {k: v for k, v in models[0].items() if k not in ("state", "reason")}
        return {
            **first,
            "version": package_version(),
            "max_waiting_requests": config.scheduler.max_waiting_requests,
            "model_control_mode": config.model_control_mode,
            "models": models,
        }

    @router.get("/metrics")
    async def metrics():
        return Response(generate_latest(repository.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @router.post("/reset_prefix_cache")
    async def reset_prefix_cache(model: str | None = Query(None, max_length=256)):
        """The first model's, or the named one's. Nothing cached before is hit again; sequences
        running keep their KV and cache what they compute from then on. 503 where a group could
        not drop its part (down, or its agent failed): the others' is dropped, retry for the rest."""
        loaded = repository.serving(model)
        try:
            dropped = await loaded.engine.drop_prefix_cache()
        except AgentError as exc:
            raise ApiError(503, f"the prefix cache was not dropped everywhere: {exc}") from exc
        if dropped["skipped_groups"]:
            raise ApiError(
                503,
                f"groups {dropped['skipped_groups']} are down: their prefix cache was not dropped "
                f"(the other groups' was: {dropped['pool_blocks']} pool and {dropped['tier_blocks']} "
                "tier blocks); retry once they are back",
            )
        return {"model": loaded.name, **dropped}

    @router.get("/dashboard")
    async def dashboard():
        return HTMLResponse(DASHBOARD.read_text(encoding="utf-8"))

    return router
