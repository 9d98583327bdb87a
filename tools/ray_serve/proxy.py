"""The front of the Ray Serve application, behind Ray Serve's HTTP proxy: every request goes to one
LLMServer replica (tools/ray_serve/routing.py picks it by prompt prefix, else by load) and its
answer streams back byte for byte. It answers itself only what no single replica can:

GET /serving/get_bs, /serving/get_request_numbers   the sums over the replicas (their query, e.g.
                                                    ?model=, goes to each); ?replica=ID: one's
GET /ray/replicas                                   the replicas' ids and the prefix-routed count
any path ?replica=ID                                that replica's answer (its /metrics, /info...)

Every request passes the replicas' key check here first (server/access.py: what the proxy answers
itself names the replicas), and its body must arrive within server.read_timeout_s (408), as with
start_server.py; Ray Serve's HTTP proxy bounds the head (tools/ray_serve/http_guard.py).
"""

# No `from __future__ import annotations`: FastAPI reads the routes' annotations as objects.
import asyncio
import json
import re
from typing import cast
from urllib.parse import parse_qsl, urlencode

from fastapi import FastAPI, Request
from ray import serve
from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator
from sse_starlette.sse import EventSourceResponse
from starlette.responses import JSONResponse, Response
from starlette.types import Receive, Scope, Send

from config.schema import RaySection, ServerSection
from server.access import ApiKeys, body_too_large, body_too_slow, key_refusal
from server.errors import error_response, path_style
from server.native_api import one_event
from tools.ray_serve import prefix  # its ROUTERS through the module: this class ships by value
from tools.ray_serve.prefix import prefix_hashes, prompt_text

REPLICA_DEPLOYMENT = "LLMServer"
SUMMED = ("/serving/get_bs", "/serving/get_request_numbers")
RETRIED = (503, 429)  # a replica's "not now" (OpenAI's clients know 429 for a full server)
EVENT_DATA = re.compile(rb"^data: (.*)$", re.MULTILINE)

app = FastAPI(title="ms-llm-serving on Ray Serve", docs_url=None, redoc_url=None, openapi_url=None)


class PassThrough(Response):
    """A replica's answer as it came: its status and headers, then its chunks as they arrive. A
    client that goes cancels the replica's side too (which aborts the generation)."""

    background = None  # FastAPI reads it off any Response a route returns

    def __init__(self, start: dict, chunks: DeploymentResponseGenerator):
        self.start, self.chunks = start, chunks

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        finished = False
        try:
            start = {"status": self.start["status"], "headers": self.start["headers"]}
            await send({"type": "http.response.start", **start})
            async for chunk in self.chunks:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            finished = True
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            if not finished:
                self.chunks.cancel()


@serve.ingress(app)
class ServingProxy:
    def __init__(self, replicas: DeploymentHandle, settings: RaySection, server: ServerSection):
        self.replicas = replicas
        self.streaming = replicas.options(stream=True)
        self.settings = settings
        self.keys = ApiKeys(server)
        self.max_body_bytes = server.max_body_bytes  # the replicas' limits
        self.read_timeout_s = server.read_timeout_s

    async def replica_ids(self) -> list[str]:
        """The replicas Ray Serve routes to now, as this proxy's router knows them."""
        if REPLICA_DEPLOYMENT not in prefix.ROUTERS:  # the router starts with the handle's first call
            await self.replicas.unique_id.remote()
        return prefix.ROUTERS[REPLICA_DEPLOYMENT].replica_ids()

    @app.get("/ray/replicas")
    async def list_replicas(self, request: Request) -> Response:
        refusal = key_refusal(self.keys, request.scope, dict(request.headers.raw), "native")
        if refusal is not None:
            return refusal
        ids = await self.replica_ids()
        routed = prefix.ROUTERS[REPLICA_DEPLOYMENT].routed_by_prefix
        return JSONResponse({"replicas": ids, "routed_by_prefix": routed})

    @app.api_route("/{path:path}", methods=["GET", "POST", "PUT", "DELETE", "PATCH", "OPTIONS", "HEAD"])
    async def forward(self, request: Request, path: str) -> Response:
        shape = path_style(request.url.path).shape  # as the replica answers the path
        refusal = key_refusal(self.keys, request.scope, dict(request.headers.raw), shape)
        if refusal is not None:
            return refusal
        try:
            async with asyncio.timeout(self.read_timeout_s):  # a body trickled in (slow POST)
                body = await self._body(request)
        except TimeoutError:
            return body_too_slow(self.read_timeout_s, shape)
        if body is None:  # refused here as the replica would, before it is held whole in memory
            return body_too_large(self.max_body_bytes, shape)
        query = parse_qsl(request.url.query, keep_blank_values=True)
        named = [v for k, v in query if k == "replica"]
        call = {
            "method": request.method,
            "path": request.url.path,
            "query_string": urlencode([(k, v) for k, v in query if k != "replica"]).encode(),
            "headers": request.headers.raw,
            "body": body,
            "client": tuple(request.client) if request.client else None,
            "server": request.scope.get("server"),
        }
        if named:
            ids = await self.replica_ids()
            if named[0] not in ids:
                return error_response(
                    404, f"replica {named[0]} does not exist (replicas: {', '.join(ids)})", "native"
                )
            return await self._answer(call, {"replica": named[0]})
        if request.method == "GET" and request.url.path in SUMMED:
            return await self._summed(call)
        text = prompt_text(request.url.path, body) if request.method == "POST" else ""
        hashes = prefix_hashes(text, self.settings.prefix_block_chars, self.settings.prefix_blocks)
        return await self._answer(call, {"prefix": hashes})

    async def _body(self, request: Request) -> bytes | None:
        """The request's body, or None once it is over max_body_bytes (whatever its headers say)."""
        body = b""
        async for chunk in request.stream():
            body += chunk
            if len(body) > self.max_body_bytes:
                return None
        return body

    async def _answer(self, call: dict, routing: dict) -> Response:
        chunks = cast(DeploymentResponseGenerator, self.streaming.handle_http.remote(call, **routing))
        start = await chunks.__anext__()
        if start["status"] in RETRIED and "prefix" in routing and "avoid" not in routing:
            # Refused before it began (the replica drains, its agents died, it is full): once
            # more on another replica, while Ray has not yet stopped routing to this one.
            async for _ in chunks:  # the refusal's small body
                pass
            return await self._answer(call, {**routing, "avoid": start["replica"]})
        return PassThrough(start, chunks)

    async def _summed(self, call: dict) -> Response:
        """One event with the sum of every replica's figure; a replica's refusal (a bad ?group=,
        a missing API key) is the answer as it gave it."""
        ids = await self.replica_ids()
        answers = await asyncio.gather(*(self._collect(call, replica) for replica in ids))
        total = 0
        for start, body in answers:
            if start["status"] != 200:
                headers = [(k, v) for k, v in start["headers"] if k.lower() != b"content-length"]
                refusal = Response(body, start["status"])  # with the length of this body
                refusal.raw_headers = [*refusal.raw_headers, *headers]
                return refusal
            found = EVENT_DATA.search(body)
            if found is None:
                return error_response(502, f"a replica answered {call['path']} without an event", "native")
            total += json.loads(found.group(1))["data"]
        return EventSourceResponse(one_event(total))

    async def _collect(self, call: dict, replica: str) -> tuple[dict, bytes]:
        chunks = cast(DeploymentResponseGenerator, self.streaming.handle_http.remote(call, replica=replica))
        start = await chunks.__anext__()
        return start, b"".join([chunk async for chunk in chunks])
