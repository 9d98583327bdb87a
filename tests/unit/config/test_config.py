"""Config files: the shipped default validates; bad values name the key."""

import subprocess
import sys
from pathlib import Path

import pytest

from config import ConfigError, load_config
from config.schema import PROJECT_ROOT, AgentsSection, RepositoryConfig, ServingConfig


def test_default_config_serves_the_embedded_model_on_cpu():
    config = load_config()
    assert config.model.path == PROJECT_ROOT / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert config.runtime.device_target == "CPU"
    # planned at start from the budget: the model's context, and a block pool shared by 64 slots
    assert (config.runtime.max_seq_len, config.runtime.num_blocks) == ("auto", "auto")
    assert config.runtime.num_slots == config.runtime.decode_batch_buckets[-1] == 64
    # Security default: nothing listens beyond this machine unless configured.
    assert config.server.host == config.agents.host == "127.0.0.1" and config.agents.curve is None


@pytest.mark.parametrize(
    "body, message",
    [
        ("runtime:\n  num_slots: 0\n", "runtime.num_slots"),
        ("runtime:\n  bogus: 1\n", "runtime.bogus"),
        (
            "runtime:\n  max_seq_len: 1024\n  attend_buckets: [256, 512, 2048]\n",
            "attend_buckets must equal max_seq_len \\(1024\\), got \\[256, 512, 2048\\]",
        ),
        ("runtime:\n  prefill_buckets: [4096]\n", "prefill_buckets may not exceed max_seq_len"),
        ("runtime:\n  num_slots: 32\n", "decode_batch_buckets must be at least num_slots"),
        ("runtime:\n  device_target: TPU\n", "runtime.device_target"),
        ("runtime:\n  block_size: 24\n", "block_size must be a power of two from 1 to 256, got 24"),
        ("scheduler:\n  max_num_batched_tokens: 16\n", "must exceed the largest decode batch \\(16\\)"),
        ("scheduler:\n  decode_stall_ratio: 1\n", "decode_stall_ratio \\(1.0\\) must exceed 1"),
        ("scheduler:\n  client_share: 0\n", "scheduler.client_share"),
        ("runtime:\n  block_size: 512\n", "block_size must be a power of two from 1 to 256, got 512"),
        ("ray:\n  min_replicas: 3\n  max_replicas: 2\n", "min_replicas \\(3\\) exceeds max_replicas \\(2\\)"),
        ("ray:\n  initial_replicas: 5\n", "initial_replicas \\(5\\) must lie within .* \\(1..2\\)"),
        ("ray:\n  min_replicas: 0\n", "ray.min_replicas"),
        ("ray:\n  target_load_per_replica: 0\n", "ray.target_load_per_replica"),
        ("ray: {}\nmodel_control_mode: explicit\n", "ray: each replica serves one model"),
        ("- a list\n", "mapping"),
        ("runtime: [unclosed\n", "not valid YAML"),
        ("agents:\n  host: 0.0.0.0\n", "reachable from other machines: set agents.curve"),
        (
            "agents:\n  ports: [9820, 9821]\n  cpu_affinity: [[0]]\n",
            "one non-empty list of CPU ids per agent",
        ),
        (
            "agents:\n  groups: [{role: prefill, ports: [9820]}]\n",
            "a prefill group needs at least one decode group",
        ),
        (
            "agents:\n  groups: [{role: decode, ports: [9820]}, {ports: [9821]}]\n",
            "a decode group needs at least one prefill",
        ),
        ("agents:\n  groups: [{ports: [9820, 9821]}]\n", "give it a cluster_port"),
        (
            "agents:\n  groups: [{role: prefill, ports: [1, 2], cluster_port: 3}, "
            "{role: decode, ports: [4]}]\n",
            "tensor-parallel group must be mixed",
        ),
        ("agents:\n  ports: [9820]\n  groups: [{ports: [9821]}]\n", "differ from the groups' ports"),
        ("agents:\n  groups: [{ports: [9820]}, {ports: [9820]}]\n", "ports must be distinct"),
        ("agents:\n  groups: [{ports: [9820], num_slots: 64}]\n", "num_slots \\(64\\) exceeds"),
        (
            "agents:\n  groups: [{ports: [9820], host: 10.1.2.3}]\n",
            "10.1.2.3 are reachable from other machines",
        ),
        (
            "model:\n  prefill_model: [a]\n  decode_model: [b]\n  argmax_model: c\n  topk_model: [d]\n"
            "agents:\n  groups: [{role: prefill, ports: [1]}, {role: decode, ports: [2]}]\n",
            "MindIR exports do not hold",
        ),
        ("server:\n  api_keys: ['']\n", "an API key is empty or blank"),
        ("server:\n  api_keys: [good-key, '  ']\n", "an API key is empty or blank"),
        (
            "agents:\n  curve: {agent_public_key: short, agent_secret_key: x, server_public_key: x, "
            "server_secret_key: x}\n",
            "Give each agent its own: `python -m tools.curve_keys --agents N`",
        ),
        (
            "agents:\n  curve: {server_public_key: short, agents: [{public_key: short}]}\n",
            "at least 40 characters",
        ),
        (
            f"agents:\n  ports: [1, 2]\n  curve: {{server_public_key: '{'k' * 40}', "
            f"agents: [{{public_key: '{'a' * 40}'}}]}}\n",
            r"one keypair per agent port \(2\), got 1",
        ),
        ("models: [{name: a}]\nmodel: {name: b}\n", "either model and runtime \\(one model\\) or models"),
        ("models: [{name: a}]\nagents: {ports: [1]}\n", "agents.ports belongs in each model's own agents"),
        ("models: [{name: a/b}]\n", "models.0.name: String should match pattern"),
        ("models: [{name: a, agents: {bogus: 1}}]\n", "models.0.agents.bogus: Extra inputs"),
        ("models: [{name: a, agents: {ports: [0]}}]\n", r"\(a\): agents.ports: .*must be distinct"),
        ("agents: {start_device_id: -1}\nmodels: [{name: a}]\n", r"\(a\): agents.start_device_id: .*greater"),
        ("models: [{name: a}]\nray: {}\n", "ray: each replica serves one model"),
        ("models: []\n", "models: List should have at least 1 item"),
        (
            "models: [{name: a, agents: {ports: [1]}}, {name: b, aliases: [a], agents: {ports: [2]}}]\n",
            "model name or alias 'a' is given to more than one model",
        ),
        (
            "models: [{name: a, agents: {ports: [1]}}, {name: b, agents: {ports: [1]}}]\n",
            "port 1 is given twice",
        ),
        (
            "model_control_mode: explicit\nagents: {control_port: 9820}\n",
            "port 9820 is given twice",
        ),
        ("model_control_mode: explicit\nstartup_models: [c]\n", "startup_models: 'c' is not a model name"),
        ("startup_models: [smollm2-135m-instruct]\n", "startup_models is for model_control_mode explicit"),
        ("model_control_mode: all\n", "model_control_mode"),
        ("agents: {memory_limit_mb: 100}\n", "needs every model's runtime.memory_budget_mb"),
        (
            "models: [{name: a, runtime: {num_slots: 0}}]\n",
            "models.0.runtime.num_slots.constrained-int: Input should be greater than or equal to 1",
        ),
        (
            "models: [{name: a, agents: {groups: [{ports: [1], num_slots: 64}]}}]\n",
            "models\\[0\\] \\(a\\): .*num_slots \\(64\\) exceeds",
        ),
        ("server:\n  admin_api_keys: ['']\n", "an API key is empty or blank"),
        ("runtime:\n  activations: int8\n  matmul: mindspore\n", "int8 runs in the fused CPU layer"),
        ("runtime:\n  activations: bfloat16\n", "activations"),
        (
            "runtime:\n  kv_cache_dtype: q8_0\n  decode_attention: gather\n",
            "q8_0 is written and read by the fused",
        ),
        ("runtime:\n  kv_cache_dtype: q4_0\n", "kv_cache_dtype: Input should be 'auto' or 'q8_0'"),
        (
            "runtime:\n  kv_cache_dtype: q8_0\nagents:\n  groups: [{ports: [1, 2], cluster_port: 3}]\n",
            "tensor-parallel groups keep kv_cache_dtype auto",
        ),
        (
            "model:\n  prefill_model: [a]\n  decode_model: [b]\n  argmax_model: c\n  topk_model: [d]\n"
            "runtime:\n  kv_cache_dtype: q8_0\n",
            "a MindIR export holds the cache it was exported with",
        ),
        (
            "model:\n  prefill_model: [a]\n  decode_model: [b]\n  argmax_model: c\n  topk_model: [d]\n"
            "runtime:\n  activations: int8\n",
            "a MindIR export holds the ops it was exported with",
        ),
    ],
)
def test_bad_config_names_the_problem(tmp_path, body, message):
    path = tmp_path / "bad.yaml"
    path.write_text(body)
    with pytest.raises(ConfigError, match=message):
        load_config(path)


@pytest.mark.parametrize(
    "max_seq_len, attend, prefill",
    [
        (1024, [256, 512, 1024], [32, 64, 128, 512]),
        (200, [200], [32, 64, 128, 200]),
        (4096, [256, 512, 2048, 4096], [32, 64, 128, 512]),
    ],
)
def test_default_buckets_follow_the_users_max_seq_len(tmp_path, max_seq_len, attend, prefill):
    """Buckets left out end at the configured max_seq_len (issue #57: 1024 alone stopped the agent)."""
    path = tmp_path / "runtime.yaml"
    path.write_text(f"runtime:\n  max_seq_len: {max_seq_len}\n")
    runtime = load_config(path).runtime
    assert (runtime.attend_buckets, runtime.prefill_buckets) == (attend, prefill)


def test_groups_give_ports_roles_and_addresses():
    config = load_config(PROJECT_ROOT / "config" / "default.yaml")
    assert [(g.role, g.ports) for g in config.agents.groups] == [("mixed", [9820])]
    agents = AgentsSection(
        groups=[
            {"role": "prefill", "ports": [7000]},
            {"role": "decode", "ports": [7001], "host": "localhost"},
        ]
    )
    assert agents.ports == [7000, 7001] and agents.roles == ["prefill", "decode"]
    assert [agents.address(r) for r in (0, 1)] == ["tcp://127.0.0.1:7000", "tcp://localhost:7001"]


def test_device_ids_count_from_start_device_id_on_each_host():
    """An agent's device is start_device_id + its rank among its own host's agents (every loopback
    address is one host): a second host's agents start again at start_device_id."""
    keys = {"public_key": "k" * 40, "secret_key": "s" * 40}
    agents = AgentsSection(
        start_device_id=2,
        groups=[
            {"ports": [7000, 7001], "cluster_port": 7100},
            {"ports": [7002], "host": "localhost"},
            {"ports": [7003, 7004], "cluster_port": 7101, "host": "10.0.0.2"},
            {"ports": [7005], "host": "10.0.0.2"},
        ],
        curve={"server_public_key": "p" * 40, "agents": [keys] * 6},
    )
    assert [agents.local_rank(r) for r in range(6)] == [0, 1, 2, 0, 1, 2]
    assert [agents.device_id(r) for r in range(6)] == [2, 3, 4, 2, 3, 4]


def test_missing_config_file(tmp_path):
    with pytest.raises(ConfigError, match="cannot read config file"):
        load_config(tmp_path / "absent.yaml")


def test_environment_overrides(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("agents:\n  ports: [9900]\n")
    config = load_config(
        environ={
            "LLM_SERVING_CONFIG": str(path),
            "LLM_SERVING__AGENTS__PORTS": "[9901, 9902]",
            "LLM_SERVING__RUNTIME__NUM_SLOTS": "8",
        }
    )
    assert config.agents.ports == [9901, 9902] and config.runtime.num_slots == 8
    with pytest.raises(ConfigError, match="agents.ports"):
        load_config(path, environ={"LLM_SERVING__AGENTS__PORTS": "[1, 1]"})


def test_api_keys_from_the_environment_add_to_the_file(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("server:\n  api_keys: [from-file]\n")
    config = load_config(path, environ={"LLM_SERVING_API_KEYS": " k1, k2 ,"})
    assert config.server.api_keys == ["from-file", "k1", "k2"]
    assert load_config(path, environ={}).server.api_keys == ["from-file"]


def test_upstream_names_are_reachable():
    from config import serving_config

    serving_config.active_config.cache_clear()
    assert serving_config.agent_ports == serving_config.AgentPorts == [9820]
    assert (serving_config.SERVER_APP_HOST, serving_config.SERVER_APP_PORT) == ("127.0.0.1", 9811)
    assert serving_config.ModelName == "smollm2-135m-instruct" and serving_config.start_device_id == 0


def test_curve_keys_tool_prints_a_section_the_config_accepts(tmp_path):
    printed = subprocess.run(
        [sys.executable, "-m", "tools.curve_keys", "--agents", "2"],
        capture_output=True,
        text=True,
        cwd=PROJECT_ROOT,
        check=True,
    ).stdout
    path = tmp_path / "remote.yaml"
    path.write_text("agents:\n  host: 10.0.0.5\n  ports: [9820, 9821]\n" + printed)
    curve = load_config(path).agents.curve
    assert curve is not None and curve.server_keypair()[1] != curve.own_agent_keypair(0)[1]
    assert len({curve.server_public_key, *(keys.public_key for keys in curve.agents)}) == 3


def test_a_repository_gives_each_model_its_config(tmp_path):
    path = tmp_path / "models.yaml"
    path.write_text(
        "model_control_mode: explicit\nstartup_models: [a]\n"
        "agents: {shutdown_grace_s: 3, control_port: 9000}\nlogging: {dir: /tmp/logs}\n"
        "models:\n"
        "  - {name: a, aliases: [x], agents: {ports: [9001]}}\n"
        "  - {name: b, runtime: {num_slots: 4}, agents: {ports: [9002, 9003], shutdown_grace_s: 7}}\n"
    )
    config = load_config(path)
    a, b = config.model_configs()["a"], config.model_configs()["b"]
    assert (a.model.aliases, a.agents.ports, a.agents.shutdown_grace_s) == (["x"], [9001], 3)
    assert (b.runtime.num_slots, b.agents.ports, b.agents.shutdown_grace_s) == (4, [9002, 9003], 7)
    # each model's agents log in a folder of its own: their agent_0.log would collide
    assert (a.logging.dir, b.logging.dir) == (
        Path("/tmp/logs/a"),
        Path("/tmp/logs/b"),
    )
    assert config.startup() == ["a"] and config.model.name == "a" and config.agents.control_port == 9000
    assert list(load_config().model_configs()) == ["smollm2-135m-instruct"]
    assert load_config().startup() == ["smollm2-135m-instruct"]


def test_admin_keys_from_the_environment_add_to_the_file(tmp_path):
    path = tmp_path / "keys.yaml"
    path.write_text("server: {admin_api_keys: [file-key]}\n")
    config = load_config(path, environ={"LLM_SERVING_ADMIN_API_KEYS": "env-1, env-2"})
    assert config.server.admin_api_keys == ["file-key", "env-1", "env-2"] and config.server.api_keys == []


def test_the_shipped_repository_serves_the_default_and_loads_gemma_on_request():
    config = load_config(PROJECT_ROOT / "config" / "model_repository.yaml")
    default, gemma = config.model_configs().values()
    assert config.model_control_mode == "explicit" and config.startup() == [default.model.name]
    assert default.model == load_config().model and default.runtime == load_config().runtime
    assert gemma.model.path.name == "gemma-3-270m-q4_k_m.gguf" and "gemma" in gemma.model.aliases
    assert (default.agents.ports, gemma.agents.ports, config.agents.control_port) == ([9820], [9821], 9819)


@pytest.mark.parametrize("path", sorted((PROJECT_ROOT / "config").glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_config_loads(path):
    assert load_config(path, environ={}).model_configs()


@pytest.mark.parametrize(
    "name, model, ranks",
    [
        ("qwen3_8b_ascend_tp2.yaml", "Qwen3-8B", 2),
        ("qwen3_30b_a3b_ascend.yaml", "Qwen3-30B-A3B", 2),
        ("qwen3_32b_ascend.yaml", "Qwen3-32B", 4),
        ("qwen3_32b_ascend_tp8.yaml", "Qwen3-32B", 8),
    ],
)
def test_shipped_ascend_tensor_parallel_configs_split_one_model_over_the_cards(name, model, ranks):
    """One group of `ranks` agents on devices 0.. of one host, with its cluster port; the Ascend
    settings the issue asks for (never run on an NPU here)."""
    config = load_config(PROJECT_ROOT / "config" / name, environ={})
    runtime, agents = config.runtime, config.agents
    assert (runtime.device_target, runtime.dtype) == ("Ascend", "bfloat16")
    assert (runtime.decode_attention, runtime.matmul) == ("paged", "mindspore")
    assert config.model.path == PROJECT_ROOT / "models" / model  # a Hugging Face directory
    assert [group.tensor_parallel for group in agents.groups] == [ranks]
    assert agents.groups[0].cluster_port is not None and agents.groups[0].role == "mixed"
    assert [agents.device_id(rank) for rank in range(ranks)] == list(range(ranks))
    assert runtime.memory_budget_mb <= agents.device_memory_mb == 65536  # a 64 GB 910B


def test_a_key_moved_to_the_scheduler_section_fails_naming_its_new_place(tmp_path):
    """The scheduling policy left the server section (issue 56): an old file is refused with each
    moved key's new place, from the file or an environment override alike."""
    path = tmp_path / "old.yaml"
    path.write_text("server:\n  port: 9900\n  client_share: 0.25\n  max_waiting_requests: 8\n")
    with pytest.raises(ConfigError) as refused:
        load_config(path, environ={})
    assert "server.client_share moved to scheduler.client_share" in str(refused.value)
    assert "server.max_waiting_requests moved to scheduler.max_waiting_requests" in str(refused.value)
    with pytest.raises(ConfigError, match="server.scheduling_policy moved to scheduler.scheduling_policy"):
        load_config(environ={"LLM_SERVING__SERVER__SCHEDULING_POLICY": "priority"})
    path.write_text("server:\n  port: 9900\nscheduler:\n  client_share: 0.25\n  max_waiting_requests: 8\n")
    moved = load_config(path, environ={"LLM_SERVING__SCHEDULER__DECODE_STALL_RATIO": "2"}).scheduler
    assert (moved.client_share, moved.max_waiting_requests, moved.decode_stall_ratio) == (0.25, 8, 2.0)


def test_the_repository_form_parses_to_its_own_type():
    """`models:` is a RepositoryConfig: entries with their own runtime, agents keys layered over the
    shared ones (CURVE too: the server's keys shared, each model its agents' keys)."""
    keys = [c * 40 for c in "sabcd"]
    data = {
        "model_control_mode": "explicit",
        "agents": {
            "shutdown_grace_s": 3,
            "curve": {"server_public_key": keys[0], "launcher": {"public_key": keys[1]}},
        },
        "scheduler": {"client_share": 0.25},
        "models": [
            {"name": "a", "agents": {"ports": [9001], "curve": {"agents": [{"public_key": keys[2]}]}}},
            {
                "name": "b",
                "runtime": {"num_slots": 4},
                "agents": {
                    "ports": [9002, 9003],
                    "shutdown_grace_s": 7,
                    "curve": {"agents": [{"public_key": keys[3]}] * 2},
                },
            },
        ],
    }
    repository = RepositoryConfig.model_validate(data)
    assert [entry.name for entry in repository.models] == ["a", "b"]
    assert repository.agents.model_fields_set == {"shutdown_grace_s", "curve"}
    b = repository.agents_of(repository.models[1])
    assert (b.ports, b.shutdown_grace_s, b.curve.server_public_key) == ([9002, 9003], 7, keys[0])
    for config in (ServingConfig.model_validate(data), ServingConfig(**data)):
        a, b = config.model_configs().values()
        assert (a.agents.shutdown_grace_s, a.agents.curve.agents[0].public_key) == (3, keys[2])
        assert (b.runtime.num_slots, b.scheduler.client_share, config.startup()) == (4, 0.25, [])
        assert config.model == a.model and config.agents.curve.launcher.public_key == keys[1]
