"""The agent processes: ports, groups (roles, tensor parallelism, hosts), CURVE keys, restarts."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, field_validator, model_validator

from config.base import Section, is_loopback

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
    """The agent processes: one per port (its rank: the port's place in `ports`, or in the groups'
    ports in order), pinned to device start_device_id + its local rank (device_id)."""

    host: str = Field("127.0.0.1", description="address the agents bind and the server connects to")
    ports: list[int] = Field(
        default_factory=lambda: [9820],
        description="upstream agent_ports; without `groups`, each port is a mixed group of its own",
    )
    groups: list[GroupSection] = Field(
        default_factory=list,
        description="agent groups with roles (they give the ports); empty: one mixed group per port",
    )
    start_device_id: int = Field(
        0, ge=0, description="the device of each host's first agent; its other agents take the next ones"
    )
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
    device_memory_mb: int | None = Field(
        None,
        ge=1,
        description="Ascend/GPU: the memory of one device (65536 for a 64 GB Ascend 910B): the "
        "launcher refuses a model whose runtime.memory_budget_mb does not fit beside the loaded "
        "models' agents on the same device; none: not checked (the budget is never held against "
        "the host's memory there)",
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

    def local_rank(self, rank: int) -> int:
        """`rank`'s place among the agents of its host (the earlier ranks at the same address;
        every loopback address is this machine's)."""
        machines = ["loopback" if is_loopback(host) else host for host in self.hosts]
        return machines[:rank].count(machines[rank])

    def device_id(self, rank: int) -> int:
        """The device of the agent at `rank`: start_device_id + its local rank, so each host's agents
        count from start_device_id (two hosts of 8 cards: devices 0..7 on each, never 8..15)."""
        return self.start_device_id + self.local_rank(rank)

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
