"""Triton's model repository extension: the models and their states, and (model_control_mode
explicit) loading and unloading them at run time. Loading and unloading need an admin key where
any key is set, an ordinary one never opens them (server/access.py).

    POST /v2/repository/index                 [{"name", "version", "state", "reason"}, ...] (body
                                              empty, or {"ready": true}: the READY models only)
    POST /v2/repository/models/{name}/load    {} once the model is READY (its agents warm and
                                              connected); 400 with the reason when it fails
    POST /v2/repository/models/{name}/unload  {} once its requests are drained and its agents gone

Both are idempotent and serialised per model (server/model_repository.py). Errors are {"error": ...}.
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ConfigDict, ValidationError

from agent.contract.launcher_control import READY
from server.errors import TRITON, declares
from server.model_repository import ModelRepository
from server.triton_api import VERSION


class IndexRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    ready: bool = False


class LoadParameters(BaseModel):
    # Triton's `config` and files (a model's configuration sent with the load) are not served.
    model_config = ConfigDict(extra="forbid")


class UnloadParameters(BaseModel):
    model_config = ConfigDict(extra="forbid")

    unload_dependents: bool = False  # no model depends on another here


class LoadRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    parameters: LoadParameters = LoadParameters()


class UnloadRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    parameters: UnloadParameters = UnloadParameters()


async def optional_body(http: Request, model: type[BaseModel]) -> BaseModel:
    """The body as `model`; an empty one (tritonclient sends none to the index) is `{}`."""
    try:
        return model.model_validate_json((await http.body()).strip() or b"{}")
    except ValidationError as exc:
        raise RequestValidationError(exc.errors()) from exc


def repository_router(repository: ModelRepository) -> APIRouter:
    router = APIRouter(prefix="/v2/repository", dependencies=[declares(TRITON)])

    @router.post("/index")
    async def index(http: Request):
        body = await optional_body(http, IndexRequest)
        assert isinstance(body, IndexRequest)
        return [
            {"name": m.name, "version": VERSION, "state": m.state, "reason": m.reason}
            for m in repository.models.values()
            if m.state == READY or not body.ready
        ]

    @router.post("/models/{name}/load")
    async def load(name: str, http: Request):
        await optional_body(http, LoadRequest)
        await repository.load(name)
        return {}

    @router.post("/models/{name}/unload")
    async def unload(name: str, http: Request):
        await optional_body(http, UnloadRequest)
        await repository.unload(name)
        return {}

    return router
