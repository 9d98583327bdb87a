"""A Python client for the native API (sync and async), streaming or not, in either stream format.

    from client import Client
    c = Client("http://127.0.0.1:9811", model="smollm2")
    c.generate("What is the capital of France?", max_new_tokens=20, chat_template=True)
    for piece in c.generate_stream("Tell me a story", protocol="plain"):
        print(piece, end="", flush=True)

    async with AsyncClient(...) as c: await c.generate(...); async for piece in c.generate_stream(...)

Parameters are checked by the same pydantic model the server uses, so a bad one fails here, before
any request. A server error raises ServerError with the server's status and message.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Literal

import httpx

from server.native_schema import ClientRequest, Parameters

DEFAULT_URL = "http://127.0.0.1:9811"


class ServerError(Exception):
    """The server answered with an error (HTTP status >= 400, or an error event mid-stream)."""

    def __init__(self, status: int | None, message: str):
        super().__init__(f"{status}: {message}" if status else message)
        self.status, self.message = status, message


@dataclass
class Piece:
    """One streamed piece of the answer."""

    text: str
    index: int


def _body(inputs: str, stream: bool, protocol: str, params: dict) -> dict:
    parameters = Parameters(**params, return_protocol=protocol)
    return ClientRequest(inputs=inputs, stream=stream, parameters=parameters).model_dump(exclude_none=True)


def _raise_for(response: httpx.Response, body: bytes) -> None:
    if response.status_code >= 400:
        try:
            message = json.loads(body)["error"]
            message = message.get("message", message) if isinstance(message, dict) else message
        except (ValueError, KeyError, TypeError, RecursionError):  # not the server's error shape
            message = body.decode(errors="replace") or response.reason_phrase
        raise ServerError(response.status_code, str(message))


def parse_stream_line(line: str, protocol: str) -> Piece | None:
    """One line of either stream format; None for lines without a piece (blank, full-text line)."""
    if not line.startswith("data:"):
        return None
    data = json.loads(line[len("data:") :])
    if "error" in data:
        raise ServerError(None, str(data["error"]))
    if protocol == "sse":
        if data.get("event") == "error":
            raise ServerError(None, str(data["data"]))
        return Piece(data["data"], -1)
    if "token" in data:
        return Piece(data["token"]["text"], data["token"]["index"])
    return None


class _Base:
    def __init__(
        self,
        url: str = DEFAULT_URL,
        model: str = "default",
        api_key: str | None = None,
        timeout: float = 600.0,
    ):
        self.url, self.model = url.rstrip("/"), model
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.timeout = timeout

    def _path(self, suffix: str = "") -> str:
        return f"{self.url}/models/{self.model}{suffix}"


class Client(_Base):
    def generate(self, inputs: str, **params) -> str:
        """The whole answer; params as in the API (max_new_tokens, do_sample, temperature, ...)."""
        response = httpx.post(
            self._path("/generate"),
            json=_body(inputs, False, "sse", params),
            headers=self.headers,
            timeout=self.timeout,
        )
        _raise_for(response, response.content)
        return response.json()["generated_text"]

    def generate_stream(
        self, inputs: str, protocol: Literal["sse", "plain"] = "sse", **params
    ) -> Iterator[str]:
        """The answer's pieces as they arrive; they join to exactly the full answer."""
        sse = protocol == "sse"
        with httpx.stream(
            "POST",
            self._path("/generate_stream"),
            json=_body(inputs, True, protocol, params),
            headers=self.headers,
            timeout=self.timeout,
        ) as response:
            if response.status_code >= 400:
                _raise_for(response, response.read())
            for line in response.iter_lines():
                piece = parse_stream_line(line, "sse" if sse else "plain")
                if piece is not None:
                    yield piece.text

    def batch_size(self) -> int:
        return self._one_event("/serving/get_bs")

    def queue_depth(self) -> int:
        return self._one_event("/serving/get_request_numbers")

    def _one_event(self, path: str) -> int:
        response = httpx.get(self.url + path, headers=self.headers, timeout=self.timeout)
        _raise_for(response, response.content)
        line = next(line for line in response.text.splitlines() if line.startswith("data:"))
        return json.loads(line[len("data:") :])["data"]


class AsyncClient(_Base):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._http = httpx.AsyncClient(timeout=self.timeout, headers=self.headers)

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._http.aclose()

    async def generate(self, inputs: str, **params) -> str:
        response = await self._http.post(self._path("/generate"), json=_body(inputs, False, "sse", params))
        _raise_for(response, response.content)
        return response.json()["generated_text"]

    async def generate_stream(
        self, inputs: str, protocol: Literal["sse", "plain"] = "sse", **params
    ) -> AsyncIterator[str]:
        async with self._http.stream(
            "POST", self._path("/generate_stream"), json=_body(inputs, True, protocol, params)
        ) as response:
            if response.status_code >= 400:
                _raise_for(response, await response.aread())
            async for line in response.aiter_lines():
                piece = parse_stream_line(line, protocol)
                if piece is not None:
                    yield piece.text
