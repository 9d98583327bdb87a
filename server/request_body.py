"""Request bodies parsed as JSON whatever their Content-Type (`curl -d` sends form-urlencoded by
default), validated by a pydantic model; failures go to the app's validation-error handler. Also
JSON text carried inside a body (a schema as a string, a call's arguments) or written by the model,
parsed with its nesting bounded as pydantic bounds a body's."""

from __future__ import annotations

import json
from typing import Any

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError

# pydantic refuses a body nested deeper; json.loads nested ~1,000 deep raises RecursionError, and a
# value that parses just under that can still exhaust the stack wherever it is encoded again.
MAX_JSON_DEPTH = 200


class TooDeep(ValueError):
    """JSON text nested deeper than MAX_JSON_DEPTH."""

    def __init__(self) -> None:
        super().__init__(f"the JSON nests deeper than {MAX_JSON_DEPTH} levels")


def json_body(model: type[BaseModel]):
    """A FastAPI dependency: `request: Model = Depends(json_body(Model))`."""

    async def parse(request: Request) -> BaseModel:
        try:
            return model.model_validate_json(await request.body())
        except ValidationError as exc:
            raise RequestValidationError(exc.errors()) from exc

    return parse


def json_value(text: str) -> Any:
    """`json.loads(text)`, where nesting deeper than MAX_JSON_DEPTH is a TooDeep (a ValueError, as
    text that is not JSON is)."""
    try:
        value = json.loads(text)
    except RecursionError:
        raise TooDeep() from None
    # Fewer brackets than the bound cannot nest deeper (str.count is cheap next to a walk).
    if text.count("[") + text.count("{") > MAX_JSON_DEPTH and _nests_deeper(value, MAX_JSON_DEPTH):
        raise TooDeep()
    return value


def _nests_deeper(value: Any, limit: int) -> bool:
    """Level by level (no recursion): whether a container sits inside `limit` others."""
    level = [value]
    for _ in range(limit):
        level = [
            child
            for v in level
            if isinstance(v, (dict, list))
            for child in (v.values() if isinstance(v, dict) else v)
        ]
        if not level:
            return False
    return any(isinstance(v, (dict, list)) for v in level)
