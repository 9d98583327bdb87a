"""Access control in front of every route, as plain ASGI middleware (it must not buffer streams):

- the Host header, when the server listens on loopback only: localhost, 127.0.0.1 or [::1], with
  the server's port or none (DNS rebinding: a web page whose name resolves to 127.0.0.1 is refused, 403);
- the Origin header a browser sends with a page's requests: only the server's own pages and
  `server.cors_origins` (a page elsewhere may POST a text/plain body, read as JSON, with no CORS
  preflight: 403 before anything runs);
- API keys (`Authorization: Bearer KEY`, or `x-api-key: KEY` as Anthropic's clients send it; every
  path but /health; the dashboard page also takes
  `?api_key=` since a browser cannot set the header for a page load); an admin key also opens every
  other path;
- loading and unloading models: only `server.admin_api_keys` where any are set. Without admin keys
  (model_control_mode explicit), an ordinary API key cannot (403 naming the setting), and with no
  key at all they are as open as the rest of the server: to this machine only, since a server that
  listens beyond loopback refuses to start in explicit mode without admin keys
  (check_model_control);
- the operator's paths (/metrics, /info, /dashboard: per-request counts, prefix-cache hits among
  them) take only `server.admin_api_keys` where any are set: an ordinary key holder could otherwise
  learn from the counters whether another client's prompt was cached;
- dropping the prefix cache (/reset_prefix_cache) takes only an admin key wherever keys are on: with
  api_keys alone nobody may (403 naming the setting), since it costs every tenant their cache;
- the request body limit (413, on the bytes read: a request body is read here, within the limit
  and within `server.read_timeout_s` (408), and handed on);
- who the client is, for the scheduler's fair shares (scheduler/client_share.py): its API key (a
  digest of it) when the key is one of the server's, or its address otherwise (keys off, or a path
  that checks none); behind a proxy, every client is the proxy.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
from urllib.parse import parse_qs

from config.schema import ServerSection, ServingConfig, is_loopback
from server.errors import ErrorShape, error_response, path_style

OPEN_PATHS = {"/health"}
OPERATOR_PATHS = {"/metrics", "/info", "/dashboard"}
# what an ordinary key may never do where any keys are set (it would cost every other tenant)
ADMIN_ONLY_PATHS = {"/reset_prefix_cache"}
QUERY_KEY_PATHS = {"/dashboard"}
ADMIN_PREFIX, ADMIN_ACTIONS = "/v2/repository/models/", ("/load", "/unload")


KEY_CLIENT = "key:"  # the prefix of a client named by its verified key (else "addr:")


def is_admin_path(path: str) -> bool:
    return path.startswith(ADMIN_PREFIX) and path.endswith(ADMIN_ACTIONS)


LOOPBACK_NAMES = ("localhost", "127.0.0.1", "[::1]")


def loopback_hosts(port: int) -> set[bytes]:
    """The Host headers that name this machine's loopback server: a rebinding page's Host names
    its own domain. (A bare name, as some hand-written clients send, names no other port.)"""
    return {f"{name}{suffix}".encode() for name in LOOPBACK_NAMES for suffix in ("", f":{port}")}


def body_too_large(max_body_bytes: int, shape: ErrorShape):
    return error_response(413, f"the request body is larger than {max_body_bytes} bytes", shape)


def body_too_slow(read_timeout_s: float, shape: ErrorShape):
    return error_response(408, f"the request body did not arrive within {read_timeout_s:g}s", shape)


def check_model_control(config: ServingConfig) -> None:
    """Refuse (ValueError naming the setting) a server that would let anyone who reaches its port
    load and unload models: model_control_mode explicit beyond loopback without admin keys."""
    s = config.server
    if config.model_control_mode == "explicit" and not is_loopback(s.host) and not s.admin_api_keys:
        raise ValueError(
            f"model_control_mode explicit with server.host {s.host} (beyond loopback) needs "
            "server.admin_api_keys (or $LLM_SERVING_ADMIN_API_KEYS): without them anyone who "
            "reaches the server could load and unload models"
        )


class ApiKeys:
    """Which keys open a path (the module docstring's rules). `model_control`: models are loaded
    and unloaded on request (model_control_mode explicit)."""

    def __init__(self, server: ServerSection, model_control: bool = False):
        self.api_keys = [k.encode() for k in server.api_keys]
        self.admin_keys = [k.encode() for k in server.admin_api_keys]
        self.admin_only = bool(self.admin_keys) or (model_control and bool(self.api_keys))

    def denied(self, scope, headers: dict) -> tuple[int, str] | None:
        """(status, why) when the request's key does not open its path."""
        path = scope["path"]
        if is_admin_path(path) and self.admin_only:
            if self.admin_keys:
                refusal = "loading and unloading models needs an admin key (server.admin_api_keys)"
            else:
                refusal = (
                    "loading and unloading models needs an admin key, and server.admin_api_keys is "
                    "empty: ordinary API keys cannot load or unload models; set server.admin_api_keys "
                    "(or $LLM_SERVING_ADMIN_API_KEYS)"
                )
            return self._admin_denied(scope, headers, refusal)
        if path in ADMIN_ONLY_PATHS and (self.admin_keys or self.api_keys):
            refusal = f"{path} needs an admin key (server.admin_api_keys)" + (
                "" if self.admin_keys else ", and none is set"
            )
            return self._admin_denied(scope, headers, refusal)
        if path in OPERATOR_PATHS and self.admin_keys:
            refusal = f"{path} is the operator's: it needs an admin key (server.admin_api_keys)"
            return self._admin_denied(scope, headers, refusal)
        if not self.api_keys or path in OPEN_PATHS:
            return None
        if self._authorized(scope, headers, self.api_keys + self.admin_keys):
            return None
        return 401, "missing or invalid API key (send Authorization: Bearer KEY)"

    def _admin_denied(self, scope, headers: dict, refusal: str) -> tuple[int, str] | None:
        """On a path that needs an admin key: None for one, 403 `refusal` for an ordinary key, 401 else."""
        if self._authorized(scope, headers, self.admin_keys):
            return None
        if self._authorized(scope, headers, self.api_keys):
            return 403, refusal
        return 401, "missing or invalid admin API key (send Authorization: Bearer KEY)"

    def client(self, scope, headers: dict) -> str:
        """Who sent a request: the digest of its key when the key is one of the server's (checked),
        else its address. Never a key nobody checked: with admin keys only, inference is open, and
        a client that made up a key for each request would be a new client each time."""
        if self._authorized(scope, headers, self.api_keys + self.admin_keys):
            return KEY_CLIENT + hashlib.sha256(self._key(scope, headers)).hexdigest()[:16]
        address = scope.get("client")
        return f"addr:{address[0]}" if address else "addr:unknown"

    @classmethod
    def _authorized(cls, scope, headers: dict, keys: list[bytes]) -> bool:
        key = cls._key(scope, headers)
        return any(hmac.compare_digest(key, k) for k in keys)

    @staticmethod
    def _key(scope, headers: dict) -> bytes:
        """The key the request sends (b"" for none)."""
        auth = headers.get(b"authorization", b"")
        key = auth[7:].strip() if auth[:7].lower() == b"bearer " else b""
        if not key:  # Anthropic's clients send their key so
            key = headers.get(b"x-api-key", b"").strip()
        if not key and scope["path"] in QUERY_KEY_PATHS:
            key = (parse_qs(scope.get("query_string", b"").decode()).get("api_key") or [""])[0].encode()
        return key


def client_of(scope) -> str:
    """The client a request came from, as the access middleware named it."""
    return scope.get("state", {}).get("client", "")


def key_refusal(keys: ApiKeys, scope, headers: dict, shape: ErrorShape):
    """The 401/403 response for a request whose key does not open its path; None when it does."""
    denied = keys.denied(scope, headers)
    if denied is None:
        return None
    status, message = denied
    return error_response(
        status, message, shape, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"}
    )


class AccessMiddleware:
    def __init__(self, app, server: ServerSection, model_control: bool = False):
        self.app = app
        self.keys = ApiKeys(server, model_control)
        self.max_body_bytes = server.max_body_bytes
        self.read_timeout_s = server.read_timeout_s
        self.port = server.port
        self.hosts = loopback_hosts(server.port) if is_loopback(server.host) else None
        self.origins = {o.encode() for o in server.cors_origins}

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"]
        shape = path_style(path).shape
        headers = dict(scope["headers"])
        refusal = self._refusal(headers)
        if refusal:
            return await error_response(403, refusal, shape, code="forbidden")(scope, receive, send)
        denied = key_refusal(self.keys, scope, headers, shape)
        if denied is not None:
            return await denied(scope, receive, send)
        scope.setdefault("state", {})["client"] = self.keys.client(scope, headers)
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body_bytes:
            return await self._too_large(scope, receive, send, shape)
        if scope["method"] not in ("POST", "PUT", "PATCH"):
            return await self.app(scope, receive, send)
        # Count what is actually read, whatever Content-Length says: with Transfer-Encoding:
        # chunked beside it, the server reads the chunks (h11 lets chunked win), of any size.
        try:
            async with asyncio.timeout(self.read_timeout_s):  # a body trickled in (slow POST)
                body = await self._read_body(receive)
        except TimeoutError:
            return await body_too_slow(self.read_timeout_s, shape)(scope, receive, send)
        if body is None:
            return None  # the client is gone
        if len(body) > self.max_body_bytes:
            return await self._too_large(scope, receive, send, shape)
        replayed = False

        async def replay():
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        return await self.app(scope, replay, send)

    async def _read_body(self, receive) -> bytes | None:
        """The body, or as much of it as passes the limit; None if the client disconnected."""
        body, more = b"", True
        while more and len(body) <= self.max_body_bytes:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            body += message.get("body", b"")
            more = message.get("more_body", False)
        return body

    def _refusal(self, headers: dict) -> str | None:
        """Why a request is refused for where it comes from (its Host and Origin headers), if it is."""
        host = headers.get(b"host")
        if self.hosts is not None and host is not None and host.lower() not in self.hosts:
            return (
                f"Host {host.decode(errors='replace')!r} is not this server: it listens on "
                f"loopback only; use {', '.join(LOOPBACK_NAMES)} (port {self.port})"
            )
        origin = headers.get(b"origin")
        if origin is None or origin in self.origins or b"*" in self.origins:
            return None
        if host is not None and origin in (b"http://" + host, b"https://" + host):
            return None  # the server's own page (the dashboard)
        return (
            f"requests from web pages at {origin.decode(errors='replace')!r} are not allowed "
            "(server.cors_origins lists the origins that are)"
        )

    async def _too_large(self, scope, receive, send, shape: ErrorShape):
        return await body_too_large(self.max_body_bytes, shape)(scope, receive, send)
