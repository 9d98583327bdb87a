"""Who may load and unload models (model_control_mode explicit), with a real launcher (its control
channel; no model loaded, so no agent starts) and real servers: admin keys beyond loopback, ordinary
keys never, and the control channel under CURVE whenever the agents are."""

from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import yaml
import zmq

from agent_harness import (
    LONG_ANSWERS_RUNTIME,
    LauncherProcess,
    curve_keys,
    free_ports,
    serving_stack,
    thread_cpu_seconds,
    worker_thread_busy,
)
from config import load_config
from waiting import wait_until

USER = "user-key"
AUTH = {"Authorization": f"Bearer {USER}"}
UNLOAD = "/v2/repository/models/tiny/unload"


def write(directory, control_port: int, http_port: int, **server) -> str:
    config = {
        "model_control_mode": "explicit",
        "models": [{"name": "tiny", "path": "models/none.gguf", "agents": {"ports": [free_ports(1)[0]]}}],
        "agents": {"control_port": control_port, "shutdown_grace_s": 1},
        "logging": {"dir": str(directory / "logs")},
        "server": {"port": http_port, **server},
    }
    path = directory / f"config-{http_port}.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


@pytest.fixture(scope="module")
def launcher(tmp_path_factory):
    directory = tmp_path_factory.mktemp("model-control")
    (control,) = free_ports(1)
    process = LauncherProcess(write(directory, control, free_ports(1)[0]))
    try:
        process.wait_for("all agents started", 60)
        yield directory, control
    finally:
        process.close()


def server_on(directory, control: int, **server) -> tuple[LauncherProcess, str]:
    (port,) = free_ports(1)
    process = LauncherProcess(write(directory, control, port, **server), script="start_server.py")
    process.wait_for("Application startup complete", 60)
    return process, f"http://127.0.0.1:{port}"


def exit_code(process: LauncherProcess, words: str) -> int | None:
    """The exit code of a process that should refuse to start, having printed `words`; one that
    starts instead is stopped."""
    try:
        process.wait_for(words, 60)
        return process.process.wait(30)
    finally:
        process.close()


def test_without_admin_keys_an_ordinary_key_cannot_load_or_unload(launcher):
    """server.admin_api_keys empty, server.api_keys set: an API key opens every endpoint but the
    loads and unloads (403 naming the setting); no key is 401, as everywhere."""
    server, base = server_on(*launcher, api_keys=[USER])
    try:
        for action in ("load", "unload"):
            reply = httpx.post(f"{base}/v2/repository/models/tiny/{action}", headers=AUTH)
            assert reply.status_code == 403, reply.text
            assert "server.admin_api_keys is empty" in reply.json()["error"], reply.text
            assert "ordinary API keys cannot load or unload" in reply.json()["error"]
        assert httpx.post(f"{base}{UNLOAD}").status_code == 401
        index = httpx.post(f"{base}/v2/repository/index", headers=AUTH)
        assert index.status_code == 200 and index.json()[0]["state"] == "UNAVAILABLE", index.text
    finally:
        server.close()


def test_without_any_key_a_loopback_server_loads_and_unloads_for_this_machine(launcher):
    server, base = server_on(*launcher)
    try:
        reply = httpx.post(f"{base}{UNLOAD}")
        assert reply.status_code == 200 and reply.json() == {}, reply.text
    finally:
        server.close()


def test_beyond_loopback_without_admin_keys_the_server_refuses_to_start(launcher):
    directory, control = launcher
    path = write(directory, control, free_ports(1)[0], host="0.0.0.0", api_keys=[USER])
    assert exit_code(LauncherProcess(path, script="start_server.py"), "needs server.admin_api_keys") == 2


def test_curve_agents_need_a_curve_control_channel(tmp_path):
    """With agents.curve, explicit mode needs agents.curve.launcher: the launcher (and the server)
    refuse the config instead of opening the control channel in plain text."""
    keys = curve_keys(1)
    path = write(tmp_path, *free_ports(2))
    config = yaml.safe_load(path.read_text())
    config["agents"]["curve"] = keys
    path.write_text(yaml.safe_dump(config))
    for script in ("start_agent.py", "start_server.py"):
        assert exit_code(LauncherProcess(path, script=script), "agents.curve.launcher is missing") == 2
    public, secret = zmq.curve_keypair()
    config["agents"]["curve"]["launcher"] = {"public_key": public.decode(), "secret_key": secret.decode()}
    path.write_text(yaml.safe_dump(config))
    assert load_config(path).agents.curve.launcher.public_key == public.decode()


@pytest.fixture(scope="module")
def loaded(tmp_path_factory, tiny_llama_dir):
    """A launcher and a server with the tiny model loaded at start (explicit mode, no keys)."""
    directory = tmp_path_factory.mktemp("loaded")
    control, agent, http = free_ports(3)
    config = {
        "model_control_mode": "explicit",
        "startup_models": ["tiny"],
        "models": [
            {
                "name": "tiny",
                "path": str(tiny_llama_dir),
                "runtime": LONG_ANSWERS_RUNTIME,
                "agents": {"ports": [agent]},
            }
        ],
        "agents": {"control_port": control, "shutdown_grace_s": 2, "startup_timeout_s": 180},
        "logging": {"dir": str(directory / "logs")},
        "server": {"port": http, "max_body_bytes": 8 << 20},
    }
    path = directory / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    with serving_stack(path) as (agents, server):
        yield f"http://127.0.0.1:{http}", server


@pytest.mark.parametrize(
    "path, parameters",
    [("/models/tiny/generate", {}), ("/models/tiny/generate_stream", {"chat_template": True})],
    ids=["generate", "stream with the chat template"],
)
def test_an_unload_while_a_prompt_is_tokenized_is_a_503(loaded, path, parameters):
    """The request found the model READY, then its long prompt was tokenized (off the event loop,
    in the model's tokenizer pool, which the unload shuts down) while the model was unloaded: it
    is refused as any request to an unloading model, 503 naming it, never a 500."""
    base, server = loaded
    assert httpx.post(f"{base}/v2/repository/models/tiny/load", timeout=120).status_code == 200
    prompt = "the quick brown fox jumps over the lazy dog " * 100_000  # seconds to tokenize
    body = {"inputs": prompt, "parameters": {"truncate": 16, "max_new_tokens": 4, **parameters}}
    with ThreadPoolExecutor(1) as pool:
        idle = thread_cpu_seconds(server.process.pid)
        answer = pool.submit(httpx.post, f"{base}{path}", json=body, timeout=120)
        wait_until(
            lambda: worker_thread_busy(server.process.pid, idle) or answer.done(),
            60,
            "the prompt tokenized in the server's pool",
        )
        unload = httpx.post(f"{base}{UNLOAD}", timeout=120)
        reply = answer.result()
    assert unload.status_code == 200, unload.text
    assert reply.status_code == 503, reply.text
    refusals = ("model 'tiny' is being unloaded", "model 'tiny' is UNLOADING")
    assert reply.json()["error"] in refusals, reply.text
    assert "Traceback" not in server.output()
