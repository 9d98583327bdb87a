"""Request bodies parsed as JSON whatever their Content-Type (`curl -d` sends form-urlencoded by
default), validated by a pydantic model; failures go to the app's validation-error handler."""

from __future__ import annotations

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError


def json_body(model: type[BaseModel]):
    """A FastAPI dependency: `request: Model = Depends(json_body(Model))`."""

    async def parse(request: Request) -> BaseModel:
        try:
            return model.model_validate_json(await request.body())
        except ValidationError as exc:
            raise RequestValidationError(exc.errors()) from exc

    return parse
