"""Typed configuration: every YAML file in config/ is validated by these models."""

from __future__ import annotations

import ipaddress
from pathlib import Path
from typing import Annotated, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    field_validator,
    model_validator,
)

PROJECT_ROOT = Path(__file__).resolve().parent.parent


def resolve_path(path: Path) -> Path:
    """Relative paths in config files are relative to the project root, not the working directory."""
    return path if path.is_absolute() else PROJECT_ROOT / path


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ModelSection(Section):
    name: str = Field("smollm2-135m-instruct", description="served model name (upstream ModelName)")
    aliases: list[str] = Field(default_factory=list)
    path: Path = Path("models/SmolLM2-135M-Instruct.Q4_1.gguf")
    # Graphs exported by `python -m tools.export` (upstream's names). When set, the agents run these
    # MindIR files instead of building the graphs from `path`, which then only gives the tokenizer.
    prefill_model: list[Path] = Field(default_factory=list, description="one MindIR file per prefill bucket")
    decode_model: list[Path] = Field(default_factory=list, description="one MindIR file per decode bucket")
    argmax_model: Path | None = None
    topk_model: list[Path] = Field(default_factory=list, description="one MindIR file per top-k bucket")

    @field_validator("path", "argmax_model")
    @classmethod
    def _absolute(cls, path: Path | None) -> Path | None:
        return None if path is None else resolve_path(path)

    @field_validator("prefill_model", "decode_model", "topk_model")
    @classmethod
    def _all_absolute(cls, paths: list[Path]) -> list[Path]:
        return [resolve_path(p) for p in paths]

    @property
    def uses_mindir(self) -> bool:
        return self.argmax_model is not None

    @model_validator(mode="after")
    def _mindir_all_or_none(self) -> ModelSection:
        given = [
            bool(self.prefill_model),
            bool(self.decode_model),
            self.argmax_model is not None,
            bool(self.topk_model),
        ]
        if any(given) and not all(given):
            raise ValueError(
                "prefill_model, decode_model, argmax_model and topk_model come together "
                "(python -m tools.export prints all four)"
            )
        return self


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def _bucket_list(values: list[int], name: str) -> list[int]:
    if not values:
        raise ValueError(f"{name} must not be empty")
    if any(v <= 0 for v in values):
        raise ValueError(f"{name} must be positive, got {values}")
    return sorted(set(values))


_UNPLANNED = (
    'runtime.{field} is still "auto": plan the runtime first '
    "(agent.memory_plan.resolve_runtime resolves it from memory_budget_mb)"
)


class SpeculationSection(Section):
    """Speculative decoding: tokens proposed for a decoding sequence are verified together in one
    step (the target's answers stay exactly its own), a win while a step is bound by reading the
    weights (few streams) and the proposals are often right (answers that copy from the prompt)."""

    method: Literal["none", "ngram", "draft"] = Field(
        "none",
        description="ngram: propose what followed the latest earlier occurrence of the sequence's "
        "last n tokens in its prompt and answer (prompt lookup); draft: the greedy tokens of "
        "draft_model, a smaller model with the same vocabulary run by each agent beside the "
        "model; none: off",
    )
    draft_model: Path | None = Field(
        None, description="method draft: the draft model's file or folder (any format the agents load)"
    )
    num_tokens: int = Field(4, ge=1, le=16, description="tokens proposed for a sequence in one step")
    ngram_min: int = Field(2, ge=1, le=8, description="the shortest n-gram matched")
    ngram_max: int = Field(4, ge=1, le=8, description="the longest n-gram matched (tried first)")
    max_batch: int = Field(
        4,
        ge=1,
        description="sequences decoding in a group beyond which nothing is proposed: with more, a "
        "step is bound by its arithmetic, not by reading the weights, and proposals cost time",
    )

    @field_validator("draft_model")
    @classmethod
    def _absolute(cls, path: Path | None) -> Path | None:
        return None if path is None else resolve_path(path)

    @model_validator(mode="after")
    def _consistent(self) -> SpeculationSection:
        if self.ngram_min > self.ngram_max:
            raise ValueError(f"ngram_min ({self.ngram_min}) exceeds ngram_max ({self.ngram_max})")
        if (self.method == "draft") != (self.draft_model is not None):
            raise ValueError("method draft needs draft_model, and draft_model needs method draft")
        return self


class RuntimeSection(Section):
    """How each agent builds and runs its graphs (shapes, KV slots, MindSpore context)."""

    @property
    def attention_kernel(self) -> bool:
        """Decode attention by the custom CPU kernel (reads each sequence's own positions from the
        cache) rather than gather + batched matmuls over an attend bucket."""
        return self.decode_attention == "kernel" or (
            self.decode_attention == "auto" and self.device_target == "CPU"
        )

    @property
    def matmul_kernel(self) -> bool:
        """The layers' matmuls by the custom CPU kernel (packed weights, skinny products) rather
        than MindSpore's MatMul."""
        return self.matmul == "kernel" or (self.matmul == "auto" and self.device_target == "CPU")

    device_target: Literal["CPU", "Ascend", "GPU"] = "CPU"
    dtype: Literal["float32", "float16", "bfloat16"] = Field(
        "float32",
        description="weights, activations and KV cache; half types on Ascend/GPU (float16 "
        "also on CPU with matmul: mindspore and decode_attention: gather)",
    )
    cpu_threads: int | None = Field(None, ge=1, description="MindSpore CPU op threads; None: its default")
    num_slots: Annotated[int, Field(ge=1)] | Literal["auto"] = Field(
        16,
        description="most sequences placed at once (each a seat with its sampling state; their "
        "KV comes from the block pool, so free blocks bound them too); auto: the largest decode "
        "batch bucket",
    )
    max_seq_len: Annotated[int, Field(ge=2)] | Literal["auto"] = Field(
        2048,
        description="positions of one sequence: prompt + generated tokens; auto: the model's "
        "context length, shortened to what memory_budget_mb holds",
    )
    num_blocks: Annotated[int, Field(ge=1)] | Literal["auto"] = Field(
        "auto",
        description="KV-cache blocks shared by every sequence; auto: what memory_budget_mb leaves "
        "after weights and working memory, or without a budget num_slots x ceil(max_seq_len / "
        "block_size) (each seat its whole length)",
    )
    memory_budget_mb: int | None = Field(
        None,
        ge=1,
        description="device memory for weights + KV cache + working memory per agent; "
        "the agent plans num_blocks (and num_slots/max_seq_len auto) from it and logs the plan",
    )
    block_size: int = Field(
        16,
        description="positions per KV-cache block (a power of two, 1..256): the cache is paged in "
        "blocks, each sequence reads its positions through a table of its blocks",
    )
    # The largest prefill bucket is the most positions one prefill call computes: a longer prompt
    # runs in chunks (fused layers), else it is the longest prompt accepted. Prefill memory grows
    # with its square (the attention scores of all layers stay allocated).
    prefill_buckets: list[int] = Field(default_factory=lambda: [32, 64, 128, 512])
    decode_batch_buckets: list[int] = Field(default_factory=lambda: [1, 4, 8, 16])
    attend_buckets: list[int] = Field(
        default_factory=lambda: [256, 512, 2048], description="attended lengths of the gather decode path"
    )
    decode_attention: Literal["auto", "kernel", "gather"] = Field(
        "auto", description="auto: the custom kernel on CPU, gather elsewhere"
    )
    matmul: Literal["auto", "kernel", "mindspore"] = Field(
        "auto", description="the layers' matmuls: auto: the custom kernel on CPU, MindSpore's elsewhere"
    )
    # Opt-in: speed at the cost of exactness (the README's "int8 activations").
    activations: Literal["float32", "int8"] = Field(
        "float32",
        description="the quantized GGUF layers' products: float32 (exact, the default) or int8 "
        "(activations quantized per block of 32 as llama.cpp does: prompts ~2x faster, decode steps "
        "faster, answers may differ; needs AVX2 or AVX512-VNNI)",
    )
    compile_cache_dir: Path | None = Field(
        Path("output/compile_cache"), description="MindSpore compile cache; null disables it"
    )
    speculation: SpeculationSection = Field(default_factory=SpeculationSection)

    @field_validator("prefill_buckets", "decode_batch_buckets", "attend_buckets")
    @classmethod
    def _buckets(cls, values: list[int], info) -> list[int]:
        return _bucket_list(values, info.field_name)

    @field_validator("block_size")
    @classmethod
    def _block_size(cls, value: int) -> int:
        if not 1 <= value <= 256 or value & (value - 1):
            raise ValueError(f"block_size must be a power of two from 1 to 256, got {value}")
        return value

    @field_validator("compile_cache_dir")
    @classmethod
    def _cache_absolute(cls, path: Path | None) -> Path | None:
        return None if path is None else resolve_path(path)

    @property
    def planned(self) -> bool:
        """num_slots, max_seq_len and num_blocks are numbers (agent.memory_plan resolves "auto")."""
        seats_and_length = self.num_slots != "auto" and self.max_seq_len != "auto"
        return seats_and_length and (self.num_blocks != "auto" or self.memory_budget_mb is None)

    @property
    def planned_num_blocks(self) -> int:
        """num_blocks once planned: the KV pool's blocks (the scratch blocks beyond them)."""
        if self.num_blocks != "auto":
            return self.num_blocks
        if self.memory_budget_mb is not None or self.num_slots == "auto" or self.max_seq_len == "auto":
            raise ValueError(_UNPLANNED.format(field="num_blocks"))
        return self.num_slots * -(-self.max_seq_len // self.block_size)  # each seat its whole length

    @property
    def planned_num_slots(self) -> int:
        """num_slots once planned: what everything that builds or runs graphs reads."""
        if self.num_slots == "auto":
            raise ValueError(_UNPLANNED.format(field="num_slots"))
        return self.num_slots

    @property
    def planned_max_seq_len(self) -> int:
        """max_seq_len once planned: what everything that builds or runs graphs reads."""
        if self.max_seq_len == "auto":
            raise ValueError(_UNPLANNED.format(field="max_seq_len"))
        return self.max_seq_len

    @model_validator(mode="after")
    def _buckets_cover_limits(self) -> RuntimeSection:
        if self.decode_attention == "kernel" and self.device_target != "CPU":
            raise ValueError(f"decode_attention: kernel is a CPU kernel; use gather on {self.device_target}")
        if self.matmul == "kernel" and self.device_target != "CPU":
            raise ValueError(f"matmul: kernel is a CPU kernel; use mindspore on {self.device_target}")
        if self.activations == "int8" and not (self.attention_kernel and self.matmul_kernel):
            raise ValueError(
                "activations: int8 runs in the fused CPU layer kernel: it needs device_target CPU "
                "with matmul and decode_attention auto or kernel"
            )
        if self.device_target == "CPU" and self.dtype == "bfloat16":
            raise ValueError("dtype bfloat16 has no MindSpore CPU kernels; use float32 (or float16)")
        if (
            self.device_target == "CPU"
            and self.dtype == "float16"
            and (self.attention_kernel or self.matmul_kernel)
        ):
            raise ValueError(
                "dtype float16 on CPU needs matmul: mindspore and decode_attention: gather "
                "(the custom CPU kernels compute in float32)"
            )
        if not self.planned:
            if self.memory_budget_mb is None and "auto" in (self.num_slots, self.max_seq_len):
                raise ValueError("num_slots/max_seq_len auto need memory_budget_mb")
            return self  # checked again once planned
        max_seq_len, num_slots = self.planned_max_seq_len, self.planned_num_slots
        if self.planned_num_blocks * self.block_size < max_seq_len:
            raise ValueError(
                f"num_blocks {self.planned_num_blocks} of {self.block_size} positions do not hold one "
                f"sequence of max_seq_len {max_seq_len}"
            )
        if self.attend_buckets[-1] != max_seq_len:
            raise ValueError(
                f"the largest of attend_buckets must equal max_seq_len "
                f"({self.max_seq_len}), got {self.attend_buckets}"
            )
        if self.prefill_buckets[-1] > max_seq_len:
            raise ValueError(
                f"prefill_buckets may not exceed max_seq_len ({self.max_seq_len}), got {self.prefill_buckets}"
            )
        if self.decode_batch_buckets[-1] < num_slots:
            raise ValueError(
                f"the largest of decode_batch_buckets must be at least num_slots "
                f"({self.num_slots}), got {self.decode_batch_buckets}"
            )
        return self


Z85Key = Annotated[str, Field(min_length=40, max_length=40, description="40-character Z85 key")]


class AgentKeys(Section):
    """One agent's CURVE keypair. The secret is needed only where that agent runs: a config file
    for another machine may leave it out."""

    public_key: Z85Key
    secret_key: Z85Key | None = None


class CurveSection(Section):
    """ZeroMQ CURVE keys (Z85 text, made by `python -m tools.curve_keys --agents N`). Every agent
    has its own keypair; an agent accepts the server's public key, and a decode agent also the
    prefill agents' keys, for KV transfers only. The server pins each agent's public key."""

    server_public_key: Z85Key
    server_secret_key: Z85Key | None = Field(None, description="needed where the server runs")
    agents: list[AgentKeys] = Field(min_length=1, description="one per agent port, in rank order")
    launcher: AgentKeys | None = Field(
        None, description="the launcher's control channel keypair (models loaded at run time)"
    )

    @model_validator(mode="before")
    @classmethod
    def _shared_agent_keypair(cls, data):
        if isinstance(data, dict) and ("agent_public_key" in data or "agent_secret_key" in data):
            raise ValueError(
                "agents.curve has changed: one shared agent keypair let every agent act as the "
                "server. Give each agent its own: `python -m tools.curve_keys --agents N` prints a "
                "new section (N: the number of agent ports)"
            )
        return data

    def own_agent_keypair(self, rank: int) -> tuple[str, str]:
        """(public, secret) of the agent at `rank`, for that agent's own process."""
        keys = self.agents[rank]
        if keys.secret_key is None:
            raise ValueError(f"agents.curve.agents[{rank}] has no secret_key: this machine runs that agent")
        return keys.public_key, keys.secret_key

    def server_keypair(self) -> tuple[str, str]:
        if self.server_secret_key is None:
            raise ValueError("agents.curve has no server_secret_key: this machine runs the server")
        return self.server_public_key, self.server_secret_key


Role = Literal["mixed", "prefill", "decode"]


class GroupSection(Section):
    """One model instance. `mixed`: prefills and decodes its own requests; `prefill`: computes
    prompts and sends their KV to a decode group; `decode`: decodes what prefill groups send it.
    Several ports: the group's agents run the model tensor-parallel (MindSpore's dynamic cluster,
    its scheduler on `cluster_port`)."""

    role: Role = "mixed"
    ports: list[int] = Field(
        min_length=1, description="one per agent of the group; several: tensor parallelism, rank 0 first"
    )
    cluster_port: int | None = Field(
        None,
        gt=0,
        lt=65536,
        description="tensor parallelism: the port "
        "of the group's MindSpore cluster scheduler (on the group's host)",
    )
    host: str | None = Field(
        None,
        description="address this group's agents bind and are reached "
        "at (another machine's, for multi-host); none: agents.host",
    )
    num_slots: int | None = Field(
        None,
        ge=1,
        description="this group's KV slots (a prefill group "
        "needs few: one per prompt in flight); none: runtime.num_slots",
    )

    @property
    def tensor_parallel(self) -> int:
        return len(self.ports)

    @model_validator(mode="after")
    def _tensor_parallel_needs(self) -> GroupSection:
        if self.tensor_parallel > 1:
            if self.cluster_port is None:
                raise ValueError(
                    f"a group of {self.tensor_parallel} agents runs tensor-parallel: "
                    f"give it a cluster_port for MindSpore's cluster scheduler"
                )
            if self.role != "mixed":
                raise ValueError(
                    "a tensor-parallel group must be mixed (KV transfer between "
                    "split caches is not supported)"
                )
        return self


class AgentsSection(Section):
    """The agent processes: one per port, pinned to device start_device_id + rank (rank: the port's
    place in `ports`, or in the groups' ports in order)."""

    host: str = Field("127.0.0.1", description="address the agents bind and the server connects to")
    ports: list[int] = Field(
        default_factory=lambda: [9820],
        description="upstream agent_ports; without `groups`, each port is a mixed group of its own",
    )
    groups: list[GroupSection] = Field(
        default_factory=list,
        description="agent groups with roles (they give the ports); empty: one mixed group per port",
    )
    start_device_id: int = Field(0, ge=0)
    startup_timeout_s: float = Field(600.0, gt=0, description="longest a start-up may take")
    kv_transfer_timeout_s: float = Field(
        10.0,
        gt=0,
        description="PD disaggregation: longest a "
        "prefill agent waits for a decode agent to take a prompt's KV",
    )
    shutdown_grace_s: float = Field(10.0, gt=0, description="SIGTERM to SIGKILL, for each agent")
    restart_policy: Literal["restart", "exit"] = "restart"
    max_restarts: int = Field(
        3, ge=0, description="restarts per agent within restart_window_s; one more death stops the launcher"
    )
    restart_window_s: float = Field(
        600.0, gt=0, description="the window max_restarts counts in: crashes further apart never add up"
    )
    curve: CurveSection | None = Field(
        None, description="CURVE encryption and authentication of the agents' sockets; required off loopback"
    )
    cpu_affinity: list[list[int]] | None = Field(
        None, description="per agent (rank order), the CPU ids it may run on; none: all of them"
    )
    control_port: int = Field(
        9819,
        gt=0,
        lt=65536,
        description="model_control_mode explicit: the launcher's control channel (loopback), "
        "where the server asks it to load and unload models",
    )
    memory_limit_mb: int | None = Field(
        None,
        ge=1,
        description="memory the agents of every loaded model may plan together (each model: "
        "runtime.memory_budget_mb x its agents); none: what the machine has available at each load",
    )

    @field_validator("ports")
    @classmethod
    def _ports(cls, ports: list[int]) -> list[int]:
        if not ports:
            raise ValueError("at least one agent port is needed")
        if len(set(ports)) != len(ports) or any(not 0 < p < 65536 for p in ports):
            raise ValueError(f"ports must be distinct and in 1..65535, got {ports}")
        return ports

    @model_validator(mode="after")
    def _ports_from_groups(self) -> AgentsSection:
        if not self.groups:
            self.groups = [GroupSection(ports=[port]) for port in self.ports]
            return self
        ports = [port for group in self.groups for port in group.ports]
        if "ports" in self.model_fields_set and ports != self.ports:
            raise ValueError(f"ports {self.ports} differ from the groups' ports {ports}: give one of them")
        self.ports = self._ports(ports)
        roles = {group.role for group in self.groups}
        if ("prefill" in roles) != ("decode" in roles):
            lone = "prefill" if "prefill" in roles else "decode"
            other = "decode" if lone == "prefill" else "prefill"
            raise ValueError(f"a {lone} group needs at least one {other} group")
        return self

    @property
    def roles(self) -> list[str]:
        """Per agent rank: its group's role."""
        return [group.role for group in self.groups for _ in group.ports]

    @property
    def rank_in_group(self) -> list[int]:
        """Per agent rank: its rank inside its group (tensor parallelism)."""
        return [i for group in self.groups for i in range(len(group.ports))]

    @property
    def group_of_rank(self) -> list[int]:
        return [index for index, group in enumerate(self.groups) for _ in group.ports]

    def group(self, rank: int) -> GroupSection:
        return self.groups[self.group_of_rank[rank]]

    @property
    def hosts(self) -> list[str]:
        """Per agent rank: the address it binds and is reached at."""
        return [group.host or self.host for group in self.groups for _ in group.ports]

    def address(self, rank: int) -> str:
        return f"tcp://{self.hosts[rank]}:{self.ports[rank]}"

    @model_validator(mode="after")
    def _one_cpu_set_per_agent(self) -> AgentsSection:
        sets = self.cpu_affinity
        if sets is not None and (
            len(sets) != len(self.ports) or not all(sets) or any(cpu < 0 for cpus in sets for cpu in cpus)
        ):
            raise ValueError(
                f"cpu_affinity needs one non-empty list of CPU ids per agent port "
                f"({len(self.ports)}), got {sets}"
            )
        return self

    @model_validator(mode="after")
    def _one_keypair_per_agent(self) -> AgentsSection:
        if self.curve is not None and len(self.curve.agents) != len(self.ports):
            raise ValueError(
                f"agents.curve.agents needs one keypair per agent port ({len(self.ports)}), "
                f"got {len(self.curve.agents)}: `python -m tools.curve_keys --agents {len(self.ports)}`"
            )
        return self

    @model_validator(mode="after")
    def _curve_off_loopback(self) -> AgentsSection:
        exposed = [host for host in [self.host, *self.hosts] if not is_loopback(host)]
        if self.curve is None and exposed:
            raise ValueError(
                f"agents on {exposed[0]} are reachable from other machines: set "
                f"agents.curve (keys from `python -m tools.curve_keys --agents N`) or bind to 127.0.0.1"
            )
        return self


class LoggingSection(Section):
    dir: Path = Path("output")
    level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"
    max_bytes: int = Field(10 * 1024 * 1024, ge=1024)
    backup_count: int = Field(5, ge=1)

    @field_validator("dir")
    @classmethod
    def _absolute(cls, path: Path) -> Path:
        return resolve_path(path)


class ServerSection(Section):
    host: str = Field("127.0.0.1", description="HTTP bind address (upstream SERVER_APP_HOST)")
    port: int = Field(9811, gt=0, lt=65536, description="HTTP port (upstream SERVER_APP_PORT)")
    agent_timeout_s: float = Field(30.0, gt=0, description="longest one agent call may take")
    agent_wait_s: float = Field(600.0, ge=0, description="how long start-up waits for the agents")
    max_waiting_requests: int = Field(64, ge=1, description="queue bound; beyond it: 503")
    max_tokens_in_flight: int | None = Field(
        131072,
        ge=1,
        description="bound on prompt + max_new_tokens over all admitted requests; "
        "beyond it: 503 (429 on the OpenAI API); null: no bound",
    )
    max_prefills_per_step: int = Field(
        16, ge=1, description="prompts placed per iteration (their chunks then share the step budget)"
    )
    max_num_batched_tokens: int = Field(
        512,
        ge=2,
        description="positions one group's step computes: its decode rows first, then prompt "
        "chunks (beside decode rows also bounded by decode_stall_ratio): a prompt alone takes "
        "fewer, longer steps",
    )
    decode_stall_ratio: float = Field(
        1.5,
        ge=0,
        description="while sequences decode, a step that also computes prompt chunks takes at most "
        "this many times a decode step alone (learned from the agents' compute times): a stream's "
        "slowest token stays this multiple of its usual one; the extra time grows in proportion "
        "while prompts wait (each weighs as a stream); 0: the token budget alone decides",
    )
    enable_prefix_caching: bool = Field(
        True, description="reuse the KV of full blocks of earlier prompts with the same prefix"
    )
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
    client_share: float = Field(
        0.5,
        gt=0,
        le=1,
        description="fairness between clients (API keys, or addresses when keys are off): once the "
        "waiting queue or the tokens in flight reach their bound, a client holding less than this "
        "share of it is still admitted (up to 1 + share times the bound), one holding more gets "
        "429; 1: no per-client share. Free slots go first to the clients running the fewest",
    )
    max_running_per_client: int | None = Field(
        None, ge=1, description="sequences one client runs at once (its others wait); none: every slot"
    )
    scheduling_policy: Literal["fcfs", "priority"] = Field(
        "fcfs",
        description="priority: requests' `priority` (lower first) orders them within their "
        "client's share; fcfs: arrival order, and a request with a priority is refused",
    )
    stream_write_timeout_s: float = Field(
        30.0,
        gt=0,
        description="a streamed answer whose client stops reading (its socket's buffers full) this "
        "long is dropped and its slot freed (gRPC: a ModelStreamInfer stream's every answer)",
    )
    max_reply_logprobs: int = Field(
        262144,
        ge=1,
        description="a non-streamed reply's logprob entries: choices x answer tokens (max_tokens, "
        "else the context) x (1 + top_logprobs); beyond it: 400 (stream it, or ask for fewer)",
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

    @field_validator("decode_stall_ratio")
    @classmethod
    def _stall_above_one(cls, ratio: float) -> float:
        if 0 < ratio <= 1:
            raise ValueError(
                f"decode_stall_ratio ({ratio}) must exceed 1 (a step with prompt chunks takes longer "
                "than a decode step alone), or be 0 to let the token budget alone decide"
            )
        return ratio

    cors_origins: list[str] = Field(
        default_factory=list,
        description="origins allowed by CORS (none: CORS off); a request from any other "
        "web page (its Origin header) gets 403",
    )


class RaySection(Section):
    """Scaling out on Ray Serve (`python -m tools.ray_serve`): each replica is one LLMServer with
    its own agents on its node; the replica count follows the load between min and max."""

    address: str | None = Field(
        None, description="a running Ray cluster to join (ray://... or HOST:PORT); none: a local instance"
    )
    min_replicas: int = Field(1, ge=1, description="replicas kept even when idle")
    max_replicas: int = Field(2, ge=1, description="replicas the load may add up to")
    initial_replicas: int | None = Field(None, ge=1, description="replicas at start; none: min_replicas")
    target_load_per_replica: float = Field(
        4.0,
        gt=0,
        description="waiting + running requests per replica the autoscaler aims at (the figures "
        "/serving/get_request_numbers and /serving/get_bs give, summed over the replicas)",
    )
    upscale_delay_s: float = Field(5.0, ge=0, description="load above target this long adds replicas")
    downscale_delay_s: float = Field(30.0, ge=0, description="load below target this long removes replicas")
    metrics_interval_s: float = Field(1.0, gt=0, description="how often each replica reports its load")
    look_back_period_s: float = Field(5.0, gt=0, description="the load is averaged over this window")
    drain_timeout_s: float = Field(
        30.0, gt=0, description="a replica being removed finishes its streams within this, then stops"
    )
    max_ongoing_requests: int = Field(
        64, ge=1, description="requests Ray Serve sends one replica at once (queued beyond: at the proxy)"
    )
    num_cpus: float = Field(1.0, ge=0, description="Ray CPUs each replica reserves")
    resources: dict[str, float] = Field(
        default_factory=dict,
        description="other Ray resources per replica, e.g. {NPU: 1} on Ascend (one per agent port)",
    )
    health_check_period_s: float = Field(2.0, gt=0, description="how often Ray asks a replica /ready")
    health_check_timeout_s: float = Field(10.0, gt=0, description="a health check slower than this fails")
    prefix_block_chars: int = Field(
        64, ge=1, description="prefix routing: characters of one prompt block (about block_size tokens)"
    )
    prefix_blocks: int = Field(
        8, ge=1, description="prefix routing: the first blocks of a prompt hashed to find its replica"
    )
    prefix_imbalance: int = Field(
        8,
        ge=0,
        description="prefix routing: the replica holding a prefix is passed over when it has this "
        "many more requests than the least loaded one",
    )

    @model_validator(mode="after")
    def _bounds(self) -> RaySection:
        if self.min_replicas > self.max_replicas:
            raise ValueError(f"min_replicas ({self.min_replicas}) exceeds max_replicas ({self.max_replicas})")
        initial = self.initial_replicas
        if initial is not None and not self.min_replicas <= initial <= self.max_replicas:
            raise ValueError(
                f"initial_replicas ({initial}) must lie within min_replicas..max_replicas "
                f"({self.min_replicas}..{self.max_replicas})"
            )
        return self


MODEL_NAME = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$"  # a log folder's name and a metric label
# Launcher settings of the agents section that are the same for every model of a repository.
PER_MODEL_AGENTS = ("ports", "groups", "cpu_affinity")


class ModelEntry(ModelSection):
    """One model of a repository (`models:`): the model section's keys plus its own runtime and
    agents (the top-level agents section's keys are the defaults of every model's)."""

    name: str = Field(pattern=MODEL_NAME, description="served model name; also its log folder's")
    runtime: RuntimeSection = Field(default_factory=RuntimeSection)
    agents: AgentsSection = Field(default_factory=AgentsSection)

    def section(self) -> ModelSection:
        return ModelSection.model_validate(self.model_dump(include=set(ModelSection.model_fields)))


class ServingConfig(Section):
    """One model (`model`, `runtime`, `agents`), or a repository of several (`models`: each its own
    model, runtime and agents); model_configs() gives each model's config in the one-model form."""

    model: ModelSection = Field(default_factory=ModelSection)
    runtime: RuntimeSection = Field(default_factory=RuntimeSection)
    agents: AgentsSection = Field(default_factory=AgentsSection)
    logging: LoggingSection = Field(default_factory=LoggingSection)
    server: ServerSection = Field(default_factory=ServerSection)
    ray: RaySection | None = Field(None, description="scaling out on Ray Serve (python -m tools.ray_serve)")
    models: list[ModelEntry] = Field(
        default_factory=list, description="several models in one server (model, runtime, agents each)"
    )
    model_control_mode: Literal["none", "explicit"] = Field(
        "none",
        description="Triton's: none starts every model; explicit starts startup_models and loads or "
        "unloads the others on request (POST /v2/repository/models/{name}/load, /unload)",
    )
    startup_models: list[str] = Field(
        default_factory=list, description="explicit mode: the models started with the launcher"
    )
    _configs: dict[str, ServingConfig] = PrivateAttr(default_factory=dict)

    @model_validator(mode="before")
    @classmethod
    def _shared_agents_into_models(cls, data):
        """The repository form: each entry's agents section over the shared one; `model`,
        `runtime` and `agents` become the first model's (for the tools that run one model)."""
        if not isinstance(data, dict) or not data.get("models") or not isinstance(data["models"], list):
            return data
        if "model" in data or "runtime" in data:
            raise ValueError("give either model and runtime (one model) or models (several), not both")
        shared = data.get("agents") or {}
        if not isinstance(shared, dict):
            return data  # the section's own validation says what is wrong
        misplaced = [key for key in PER_MODEL_AGENTS if key in shared]
        if misplaced:
            raise ValueError(
                f"agents.{misplaced[0]} belongs in each model's own agents section (models[i].agents)"
            )
        entries = []
        for entry in data["models"]:
            own = (entry.get("agents") or {}) if isinstance(entry, dict) else None
            if not isinstance(entry, dict) or not isinstance(own, dict):
                entries.append(entry)  # the entry's own validation says what is wrong
                continue
            agents = {**shared, **own}
            if isinstance(shared.get("curve"), dict) and isinstance(own.get("curve"), dict):
                agents["curve"] = {**shared["curve"], **own["curve"]}
            entries.append({**entry, "agents": agents})
        first = entries[0] if isinstance(entries[0], dict) else {}
        return {
            **data,
            "models": entries,
            "model": {k: v for k, v in first.items() if k not in ("runtime", "agents")},
            "runtime": first.get("runtime", {}),
            "agents": first.get("agents", shared),
        }

    @model_validator(mode="after")
    def _one_config_per_model(self) -> ServingConfig:
        if not self.models:
            return self  # model_configs(): itself (a copy's, its own)
        configs: dict[str, ServingConfig] = {}
        for index, entry in enumerate(self.models):
            try:
                configs[entry.name] = ServingConfig(
                    model=entry.section(),
                    runtime=entry.runtime,
                    agents=entry.agents,
                    logging=self.logging.model_copy(update={"dir": self.logging.dir / entry.name}),
                    server=self.server,
                )
            except ValidationError as exc:
                problems = "; ".join(e["msg"] for e in exc.errors())
                raise ValueError(f"models[{index}] ({entry.name}): {problems}") from None
        self._configs = configs
        return self

    @model_validator(mode="after")
    def _models_apart(self) -> ServingConfig:
        names = [name for c in self.model_configs().values() for name in (c.model.name, *c.model.aliases)]
        twice = sorted({name for name in names if names.count(name) > 1})
        if twice:
            raise ValueError(f"model name or alias {twice[0]!r} is given to more than one model")
        ports = [p for c in self.model_configs().values() for p in c.agents.ports]
        ports += [
            g.cluster_port for c in self.model_configs().values() for g in c.agents.groups if g.cluster_port
        ]
        if self.model_control_mode == "explicit":
            ports.append(self.agents.control_port)
        taken = sorted({port for port in ports if ports.count(port) > 1})
        if taken:
            raise ValueError(
                f"port {taken[0]} is given twice (agents, cluster schedulers, agents.control_port)"
            )
        unknown = [name for name in self.startup_models if name not in self.model_configs()]
        if unknown:
            raise ValueError(
                f"startup_models: {unknown[0]!r} is not a model name ({', '.join(self.model_configs())})"
            )
        if self.startup_models and self.model_control_mode == "none":
            raise ValueError("startup_models is for model_control_mode explicit (none starts every model)")
        curve = self.agents.curve
        secured = any(c.agents.curve is not None for c in self.model_configs().values())
        if self.model_control_mode == "explicit" and secured and (curve is None or curve.launcher is None):
            raise ValueError(
                "agents.curve.launcher is missing: the agents use CURVE, so the launcher's control "
                "channel (model_control_mode explicit) must too; `python -m tools.curve_keys --launcher` "
                "prints a keypair for it"
            )
        if self.agents.memory_limit_mb is not None:
            unplanned = [n for n, c in self.model_configs().items() if c.runtime.memory_budget_mb is None]
            if unplanned:
                raise ValueError(
                    f"agents.memory_limit_mb needs every model's runtime.memory_budget_mb "
                    f"(what its agents may use); {unplanned[0]!r} has none"
                )
        return self

    def model_configs(self) -> dict[str, ServingConfig]:
        """Each model's config in the one-model form (a one-model config: itself), by name."""
        return self._configs or {self.model.name: self}

    def startup(self) -> list[str]:
        """The models started with the launcher (and connected by the server at its start)."""
        return list(self.model_configs()) if self.model_control_mode == "none" else self.startup_models

    @model_validator(mode="after")
    def _ray_serves_one_model(self) -> ServingConfig:
        if self.ray is not None and (self.models or self.model_control_mode == "explicit"):
            raise ValueError(
                "ray: each replica serves one model (model, runtime, agents), started with it: "
                "models: and model_control_mode explicit are for one server"
            )
        return self

    @model_validator(mode="after")
    def _groups_fit_the_runtime(self) -> ServingConfig:
        largest = self.runtime.decode_batch_buckets[-1]
        for index, group in enumerate(self.agents.groups):
            if group.num_slots is not None and group.num_slots > largest:
                raise ValueError(
                    f"agents.groups[{index}].num_slots ({group.num_slots}) exceeds the "
                    f"largest of runtime.decode_batch_buckets ({largest})"
                )
        return self

    @model_validator(mode="after")
    def _step_budget_leaves_room_for_prompts(self) -> ServingConfig:
        rows = self.runtime.decode_batch_buckets[-1]
        if self.server.max_num_batched_tokens <= rows:
            raise ValueError(
                f"server.max_num_batched_tokens ({self.server.max_num_batched_tokens}) must exceed the "
                f"largest decode batch ({rows}): a step whose every seat decodes would leave no "
                f"positions for prompts, which would wait until a stream ends"
            )
        return self

    @model_validator(mode="after")
    def _disaggregation_needs_code_graphs(self) -> ServingConfig:
        roles = set(self.agents.roles)
        if self.model.uses_mindir and roles != {"mixed"}:
            raise ValueError(
                "prefill and decode groups run the KV transfer graphs, which MindIR "
                "exports do not hold: serve them from model.path"
            )
        if self.model.uses_mindir and any(g.tensor_parallel > 1 for g in self.agents.groups):
            raise ValueError(
                "tensor-parallel groups build split graphs from model.path; MindIR "
                "exports hold the whole model"
            )
        if self.model.uses_mindir and self.runtime.activations == "int8":
            raise ValueError(
                "runtime.activations: int8 picks the kernels of graphs built from model.path; "
                "a MindIR export holds the ops it was exported with"
            )
        return self
