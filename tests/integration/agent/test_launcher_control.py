"""The launcher's control channel on real ZeroMQ sockets, in one process: the server's client
(server/launcher_client.py) against the launcher's socket (agent/launcher/control.py), with
CURVE keys (only the server's key is answered) and the message bound; then the launcher's models
in-process with real agents, where a failed spawn fails one model's load or restart, nothing else."""

import asyncio
import os
import signal
import threading

import pytest
import zmq

from agent.contract import launcher_control as control
from agent.launcher.control import ControlChannel
from agent_harness import LONG_ANSWERS_RUNTIME, curve_keys, free_ports
from config.schema import ServingConfig
from server.launcher_client import LauncherClient, LauncherError, LauncherUnreachable
from waiting import wait_until


def config_of(port: int, curve: dict | None) -> ServingConfig:
    agents: dict = {"ports": [free_ports(1)[0]], "control_port": port, "shutdown_grace_s": 1}
    if curve is not None:
        agents["curve"] = curve
    return ServingConfig.model_validate({"model_control_mode": "explicit", "agents": agents})


@pytest.fixture
def channel():
    """A launcher's channel with CURVE keys, answering in a thread; yields its config."""
    (port,) = free_ports(1)
    public, secret = zmq.curve_keypair()
    keys = {**curve_keys(1), "launcher": {"public_key": public.decode(), "secret_key": secret.decode()}}
    config = config_of(port, keys)
    channel, stop = ControlChannel(config), threading.Event()
    asked: list[dict] = []

    def handle(message: dict) -> dict:
        asked.append(message)
        return {"ok": message.get("op") == "status", "models": {}, "error": "refused here"}

    def serve():
        while not stop.is_set():
            channel.answer(handle, 0.05)

    thread = threading.Thread(target=serve)
    thread.start()
    yield config, asked
    stop.set()
    thread.join()
    channel.close()


def call(config: ServingConfig, op: str, timeout_s: float = 2.0, **fields) -> dict:
    async def go():
        client = LauncherClient(config)
        client.timeout_s = timeout_s
        try:
            return await client.call(op, **fields)
        finally:
            client.close()

    return asyncio.run(go())


def test_the_server_key_is_answered_and_a_refusal_is_an_error(channel):
    config, asked = channel
    assert call(config, "status") == {"ok": True, "models": {}, "error": "refused here"}
    with pytest.raises(LauncherError, match="refused here"):
        call(config, "load", model="x")
    assert asked == [{"op": "status"}, {"op": "load", "model": "x"}]


def test_another_key_or_no_key_gets_no_answer(channel):
    config, asked = channel
    stranger = config.model_copy(deep=True)
    assert stranger.agents.curve is not None
    public, secret = zmq.curve_keypair()
    stranger.agents.curve.server_public_key, stranger.agents.curve.server_secret_key = (
        public.decode(),
        secret.decode(),
    )
    with pytest.raises(LauncherUnreachable, match="did not answer"):
        call(stranger, "status", timeout_s=1.0)
    plain = config.model_copy(deep=True)
    plain.agents.curve = None
    with pytest.raises(LauncherUnreachable):
        call(plain, "status", timeout_s=1.0)
    assert asked == []


def test_a_message_over_the_bound_is_dropped_unread(channel):
    config, asked = channel
    with pytest.raises(LauncherUnreachable):
        call(config, "status", timeout_s=1.0, padding="x" * control.MAX_MESSAGE_BYTES)
    assert asked == [] and call(config, "status")["ok"]


def test_a_taken_port_fails_the_channel_and_bad_messages_get_an_error():
    (port,) = free_ports(1)
    first = ControlChannel(config_of(port, None))
    try:
        with pytest.raises(zmq.ZMQError):
            ControlChannel(config_of(port, None))
        socket = zmq.Context.instance().socket(zmq.DEALER)
        socket.setsockopt(zmq.LINGER, 0)
        socket.connect(f"tcp://127.0.0.1:{port}")
        for frame in (b"\xc1", control.encode([1, 2])):  # not msgpack; not a map
            socket.send(frame)
            first.answer(lambda m: {"ok": True}, 2.0)
            assert socket.poll(2000)
            assert control.decode(socket.recv())["ok"] is False
        socket.close()
    finally:
        first.close()


def test_the_launcher_answers_malformed_requests_with_an_error():
    """LaunchedModels' handler, in-process (nothing started): every malformed request gets an
    error reply, and the launcher goes on."""
    from agent.launcher.models import LaunchedModels

    models = LaunchedModels(config_of(free_ports(1)[0], None))
    assert (
        models._handle({"op": "status", "model": ["x"]})["models"]["smollm2-135m-instruct"]["state"]
        == "UNAVAILABLE"
    )
    assert list(models._handle({"op": "status", "model": "smollm2-135m-instruct"})["models"]) == [
        "smollm2-135m-instruct"
    ]
    for message, words in [
        ({"op": "reboot"}, "unknown op 'reboot'"),
        ({}, "unknown op None"),
        ({"op": "load", "model": ["x"]}, "no model ['x']"),
        (
            {"op": "unload", "model": "gpt-5"},
            "no model 'gpt-5' in the launcher's config (smollm2-135m-instruct)",
        ),
    ]:
        reply = models._handle(message)
        assert reply["ok"] is False and words in reply["error"], reply


@pytest.fixture(scope="module")
def launched(tmp_path_factory, tiny_llama_dir):
    """LaunchedModels in-process, supervising in a thread, with its real control channel: model
    `a` (one real agent) loaded at start, `b` (two agents) and `c` loadable. Spawning an agent of
    a model in `faults` raises as the OS would refuse a new process."""
    from agent.launcher.model_agents import AgentLauncher
    from agent.launcher.models import LaunchedModels

    control_port, *ports = free_ports(5)
    runtime = {**LONG_ANSWERS_RUNTIME, "num_slots": 2, "decode_batch_buckets": [1, 2]}

    def model(name: str, agent_ports: list[int]) -> dict:
        return {
            "name": name,
            "path": str(tiny_llama_dir),
            "runtime": runtime,
            "agents": {"ports": agent_ports},
        }

    config = ServingConfig.model_validate(
        {
            "model_control_mode": "explicit",
            "startup_models": ["a"],
            "agents": {"control_port": control_port, "shutdown_grace_s": 2, "startup_timeout_s": 180},
            "logging": {"dir": str(tmp_path_factory.mktemp("launched") / "logs")},
            "models": [model("a", ports[:1]), model("b", ports[1:3]), model("c", ports[3:])],
        }
    )
    faults: dict[str, int] = {}  # model -> the rank whose spawn fails
    spawned: list[int] = []  # pids of the agents spawned for the faulty models
    original = AgentLauncher._spawn

    def spawn(self, agent):
        name = self.config.model.name
        if faults.get(name) == agent.rank:
            raise OSError(11, "Resource temporarily unavailable")  # fork's EAGAIN
        original(self, agent)
        if name in faults:
            spawned.append(agent.process.pid)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(AgentLauncher, "_spawn", spawn)
        models = LaunchedModels(config)
        models.start()
        supervising = threading.Thread(target=models.supervise)
        supervising.start()
        try:
            yield models, config, faults, spawned, ports
        finally:
            models.stop_signal = signal.SIGTERM
            supervising.join(60)
            models.stop()  # what a supervise() that died left running


def test_a_failed_spawn_fails_that_load_only(launched):
    """The spawn of a model's second agent raises (a mock: the OS refusing a process, which root
    here cannot be made to): the load answers that error, the agent spawned before it is stopped,
    the model is UNAVAILABLE with the reason; the launcher goes on answering and supervising, the
    loaded model keeps serving, and the same model loads once the fault is gone."""
    from agent_harness import AgentSocket, alive, wait_gone

    models, config, faults, spawned, ports = launched
    faults["b"] = 1
    with pytest.raises(LauncherError, match="Resource temporarily unavailable"):
        call(config, "load", timeout_s=30, model="b")
    status = call(config, "status", timeout_s=30)["models"]
    assert status["b"]["state"] == "UNAVAILABLE" and status["b"]["pids"] == []
    assert "starting its agents failed: BlockingIOError" in status["b"]["reason"]
    assert len(spawned) == 1 and wait_gone(spawned, 30) == [], "the agent spawned before the failure"
    assert status["a"]["state"] == "READY" and all(alive(pid) for pid in status["a"]["pids"])
    agent = AgentSocket(ports[0], session=False)
    try:
        assert agent.call("ping")[0]["ok"]
    finally:
        agent.close()
    faults.clear()
    assert call(config, "load", timeout_s=30, model="b")["state"] == "LOADING"
    assert call(config, "unload", timeout_s=30, model="b")["state"] == "UNAVAILABLE"


def test_a_failed_restart_fails_that_model_only(launched):
    """A loaded model's agent dies and its restart's spawn raises (the same mock): that model is
    UNAVAILABLE with the reason, the launcher and the other model go on."""
    from agent_harness import alive

    models, config, faults, _, _ = launched
    assert call(config, "load", timeout_s=30, model="c")["ok"]
    wait_until(
        lambda: call(config, "status", timeout_s=30, model="c")["models"]["c"]["state"] == "READY",
        180,
        "c loaded",
        poll_s=0.5,
    )
    (pid,) = call(config, "status", timeout_s=30, model="c")["models"]["c"]["pids"]
    faults["c"] = 0
    os.kill(pid, signal.SIGKILL)

    def unavailable() -> dict | None:
        states = call(config, "status", timeout_s=30)["models"]
        return states if states["c"]["state"] == "UNAVAILABLE" else None

    c = wait_until(unavailable, 30, "c UNAVAILABLE", poll_s=0.2)
    assert "supervising its agents failed: BlockingIOError" in c["c"]["reason"], c
    assert c["a"]["state"] == "READY" and all(alive(p) for p in c["a"]["pids"])
