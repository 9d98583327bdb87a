"""The HTTP and gRPC front end: addresses, keys, limits on connections and bodies, stored responses,
tracing. What the scheduler decides (queue bounds, step budget, fairness) is config/scheduler.py's."""

from __future__ import annotations

from pydantic import Field, field_validator, model_validator

from config.base import Section
from config.scheduler import MOVED_FROM_SERVER


class ServerSection(Section):
    """The front end's own settings; the scheduling policy is the scheduler section's."""

    host: str = Field("127.0.0.1", description="HTTP bind address (upstream SERVER_APP_HOST)")
    port: int = Field(9811, gt=0, lt=65536, description="HTTP port (upstream SERVER_APP_PORT)")
    agent_timeout_s: float = Field(30.0, gt=0, description="longest one agent call may take")
    agent_wait_s: float = Field(600.0, ge=0, description="how long start-up waits for the agents")
    drain_timeout_s: float = Field(
        30.0, gt=0, description="on SIGTERM, how long running requests may take to finish"
    )
    apply_chat_template: bool = Field(
        False, description="wrap `inputs` in the model's chat template (a request may override)"
    )
    api_keys: list[str] = Field(
        default_factory=list,
        description="if any: every endpoint but "
        "/health needs `Authorization: Bearer KEY` (also $LLM_SERVING_API_KEYS)",
    )
    max_body_bytes: int = Field(1 << 20, ge=1024, description="larger request bodies get 413")
    max_connections: int = Field(
        256, ge=1, description="open connections (or requests) beyond which a request gets 503"
    )
    read_timeout_s: float = Field(
        10.0,
        gt=0,
        description="a request's head, and then its body, must each arrive within this "
        "(slow clients): else the connection is closed (408 for a body; gRPC: a unary call's "
        "message, else DEADLINE_EXCEEDED)",
    )
    keep_alive_s: int = Field(5, ge=1, description="an idle connection is closed after this")
    stream_write_timeout_s: float = Field(
        30.0,
        gt=0,
        description="a streamed answer whose client stops reading (its socket's buffers full) this "
        "long is dropped and its slot freed (gRPC: a ModelStreamInfer stream's every answer)",
    )
    max_reply_logprobs: int = Field(
        262144,
        ge=1,
        description="a reply's logprob entries: choices x (prompt tokens x (1 + prompt_logprobs), "
        "streamed or not, + for a non-streamed reply answer tokens (max_tokens, else the context) "
        "x (1 + top_logprobs)); beyond it: 400 (stream it, or ask for fewer)",
    )
    max_pooling_inputs: int = Field(
        2048,
        ge=1,
        description="inputs of one embeddings, rerank or score request (OpenAI's bound); more: 400",
    )
    max_pooling_tokens: int = Field(
        300_000,
        ge=1,
        description="tokens of one embeddings, rerank or score request, all inputs together (OpenAI's "
        "bound); more: 400",
    )
    max_grammar_bytes: int = Field(
        32768,
        ge=64,
        description="a structured-output grammar's size (JSON Schema text, regex, Lark grammar, "
        "choices); larger: 400",
    )
    grammar_compile_timeout_s: float = Field(
        10.0, gt=0, description="a grammar that compiles longer is refused (400), and so is its next try"
    )
    responses_store_size: int = Field(
        1024,
        ge=0,
        description="responses /v1/responses keeps for previous_response_id (in memory, least recently "
        "used dropped first; each holds its conversation); 0: none is kept",
    )
    responses_ttl_s: float = Field(
        3600.0, gt=0, description="how long a kept response stays usable as previous_response_id"
    )
    responses_store_bytes: int = Field(
        256 << 20,
        ge=0,
        description="the kept responses' size in all (their JSON); beyond it the client holding the "
        "most loses its least recently used",
    )
    responses_entry_bytes: int = Field(
        4 << 20,
        ge=0,
        description="a response whose JSON (with its conversation) is larger is not kept: its reply "
        "says store: false and why (store_refused)",
    )
    responses_client_entries: int = Field(
        256, ge=0, description="responses one client (API key, or address) keeps; beyond: its own oldest go"
    )
    responses_client_bytes: int = Field(
        64 << 20, ge=0, description="their size for one client; beyond: its own least recently used go"
    )
    grpc_port: int | None = Field(
        None,
        gt=0,
        lt=65536,
        description="KServe v2 gRPC (Triton's GRPCInferenceService) on server.host at this port, "
        "beside HTTP, with the same keys and limits; none: off",
    )
    grpc_max_calls_per_peer: int = Field(
        64,
        ge=1,
        description="gRPC calls one client address has open at once (of server.max_connections); "
        "beyond it: RESOURCE_EXHAUSTED (behind a proxy, every client is the proxy)",
    )
    grpc_idle_timeout_s: float = Field(
        60.0,
        gt=0,
        description="a gRPC stream with no request running that sends none this long is ended "
        "(DEADLINE_EXCEEDED), and a connection with no call is closed",
    )
    grpc_stream_max_requests: int = Field(
        32,
        ge=1,
        description="requests one gRPC stream runs at once, and replies it holds unsent; beyond: "
        "its next message is not read until one ends (back-pressure)",
    )
    otlp_endpoint: str | None = Field(
        None,
        description="OpenTelemetry: export a trace of every request (queueing, prefill chunks, "
        "decode, agent calls) over OTLP/gRPC to this collector (http://HOST:4317); none: off, "
        "at no cost",
    )

    prefix_cache_per_key: bool = Field(
        True,
        description="with keys on, each key's requests share cached prompt blocks (in every tier) only "
        "with that key's: its verified identity salts the cache (a request's cache_salt adds to it). "
        "false: one cache for all keys (single-tenant deployments), and a key's time to first token "
        "then shows whether another key sent a prompt",
    )
    admin_api_keys: list[str] = Field(
        default_factory=list,
        description="the only keys that may load and unload models (also $LLM_SERVING_ADMIN_API_KEYS); "
        "none: with api_keys nobody may, without keys anyone on this machine (model_control_mode "
        "explicit beyond loopback needs them)",
    )

    @field_validator("api_keys", "admin_api_keys")
    @classmethod
    def _no_empty_key(cls, keys: list[str]) -> list[str]:
        # An empty key would match a request without one (a templated key whose variable is unset).
        if any(not key.strip() for key in keys):
            raise ValueError(
                "an API key is empty or blank (an unset variable in a template?); "
                "remove it, or give every key a value"
            )
        return keys

    cors_origins: list[str] = Field(
        default_factory=list,
        description="origins allowed by CORS (none: CORS off); a request from any other "
        "web page (its Origin header) gets 403",
    )

    @model_validator(mode="before")
    @classmethod
    def _moved_to_scheduler(cls, data):
        """A file from before the scheduler section fails naming each key's new place: accepting both
        places would give a setting two homes, one silently winning."""
        moved = [key for key in MOVED_FROM_SERVER if isinstance(data, dict) and key in data]
        if moved:
            raise ValueError("; ".join(f"server.{key} moved to scheduler.{key}" for key in moved))
        return data
