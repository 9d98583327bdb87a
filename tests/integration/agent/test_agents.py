"""start_agent.py end to end: real agent processes, real ZeroMQ sockets, real signals."""

import asyncio
import os
import pickle
import signal
import subprocess
import sys
import threading

import numpy as np
import psutil
import pytest
import zmq

import runner_calls as calls
from agent.contract import protocol
from agent.contract.sampling import SamplingParams
from agent.contract.transport import ClientKeys
from agent.launcher.model_agents import RestartBudget
from agent.model.tokenizer import load_tokenizer
from agent_harness import (
    AgentSocket,
    LauncherProcess,
    alive,
    curve_keys,
    free_ports,
    slot_blocks,
    wait_gone,
    write_config,
)
from config import load_config
from config.schema import PROJECT_ROOT
from scheduler.agent_client import AgentClient, AgentUnavailable
from waiting import wait_until

START_TIMEOUT = 240


@pytest.fixture
def launch(tmp_path):
    """launch(model_path, n_agents, **config sections) -> (LauncherProcess, ports); always cleaned up."""
    started: list[LauncherProcess] = []

    def _launch(model_path, n_agents=1, **sections):
        ports = free_ports(n_agents)
        process = LauncherProcess(write_config(tmp_path, model_path, ports, **sections))
        started.append(process)
        return process, ports

    yield _launch
    for process in started:
        process.close()


@pytest.fixture(scope="module")
def two_agents(tmp_path_factory, tiny_llama_dir):
    """One launcher with two agents, shared by the tests that only talk to them."""
    ports = free_ports(2)
    directory = tmp_path_factory.mktemp("two-agents")
    launcher = LauncherProcess(write_config(directory, tiny_llama_dir, ports))
    try:
        launcher.wait_for("all agents started", START_TIMEOUT)
        yield launcher, ports, directory
    finally:
        launcher.close()


def test_two_agents_report_ready_and_answer_like_the_runner(
    two_agents, tiny_llama_runner, tiny_llama_dir, release_all
):
    launcher, ports, directory = two_agents
    ready = [launcher.wait_for(f"agent rank {r} ready on 127.0.0.1:{p} (pid", 1) for r, p in enumerate(ports)]
    assert launcher.wait_for("all agents started", 1) > max(ready)
    assert sum("ready on" in line for line in launcher.lines) == 2
    assert (directory / "logs" / "agent_launcher.log").is_file()
    # every performance figure can say which machine made it: the CPU and what the kernels run on it
    assert "; kernels: native (" in (directory / "logs" / "agent_0.log").read_text()

    release_all(tiny_llama_runner)
    prompt = load_tokenizer(tiny_llama_dir).encode("The quick brown fox")
    want = [calls.prefill(tiny_llama_runner, 0, prompt, SamplingParams())]
    want += [calls.decode(tiny_llama_runner, [0])[0] for _ in range(7)]
    for rank, port in enumerate(ports):
        client = AgentSocket(port)
        info, _ = client.call("info")
        assert info["ok"] and info["rank"] == rank and info["port"] == port
        assert info["protocol"] == protocol.PROTOCOL_VERSION and info["num_slots"] == 4
        assert info["max_seq_len"] == 64 and info["role"] == "mixed" and info["model"] == "tiny"
        reply, _ = client.prefill(1, prompt)
        got = [reply["chunk_tokens"][0]]
        for _ in range(7):
            reply, arrays = client.decode([1])
            assert reply["ok"], reply
            got.append(int(arrays[0][0]))
        assert got == want
        assert client.call("release", slot=1)[0]["ok"]
        client.close()


def spec_frames(spec, frame: bytes) -> list:
    """A step request whose one array is described by `spec`, as a hostile peer may send it."""
    import msgpack

    header = {"v": protocol.PROTOCOL_VERSION, "op": "step", "id": 1, "arrays": [spec]}
    return [msgpack.packb(header), frame]


def step_arrays(slots: list[int], tables: list[list[int]]) -> list[np.ndarray]:
    """A step's arrays: decode slots and tables, then one chunk's tokens and table."""
    table = np.array(tables, np.int32).reshape(len(slots), len(tables[0]) if tables else 0)
    return [np.array(slots, np.int32), table, np.array([5, 6], np.int32), np.array([0], np.int32)]


@pytest.mark.parametrize(
    "frames_or_call, error",
    [
        (lambda c: c.raw([b"\xff\x00 garbage"]), "header is not msgpack"),
        # No pickle on the wire: a pickled request is refused as bytes, never unpickled.
        (lambda c: c.raw([pickle.dumps({"op": "ping", "id": 1})]), "header is not msgpack"),
        (lambda c: c.raw([b"\x93\x01\x02\x03"]), "header must be a msgpack map"),
        (lambda c: c.call("fly"), "unknown op 'fly'"),
        (
            lambda c: c.raw(
                [protocol.encode({"op": "step", "id": 1}, [np.array([0], np.int32)])[0], b"\x00" * 7]
            ),
            "7 bytes do not match int32[1]",
        ),
        (lambda c: c.prefill(99, [1, 2]), "slot 99 is out of range"),
        (lambda c: c.prefill(0, np.ones(64)), "exceeds the longest prompt"),
        (lambda c: c.prefill(0, [1], sampling={"top_p": 7}), "top_p"),
        (lambda c: c.prefill(0, [1], sample="yes"), "sample (true or false)"),
        (lambda c: c.prefill(0, [1], sample=False), "its sampling when it samples, and only then"),
        (
            lambda c: c.call("step", [*step_arrays([], [])[:3], slot_blocks(0)[None]], chunks=[{"slot": 0}]),
            "2 1-D integer arrays: token ids, block table",
        ),
        (lambda c: c.prefill(0, [1, 2], start=5), "after the 0 the slot holds"),
        (lambda c: c.decode([3]), "slot 3 holds no sequence"),
        (lambda c: c.call("step", [np.array([3], np.int32)], chunks=[]), "slot ids [n], their block tables"),
        (
            lambda c: c.call("step", step_arrays([], [])[:2], chunks=[]),
            "decodes slots, computes prompt chunks",
        ),
        (lambda c: c.call("release", slot="x"), "must be an integer"),
        (lambda c: c.call("step", [], chunks="x"), "a list of up to 4 chunks"),
        (lambda c: c.call("step", [], chunks=[{}]), "decode slot ids [n], their block tables"),
        (lambda c: c.call("step", step_arrays([0], [[1]]), chunks=[{"slot": 1}]), "sample (true or false)"),
        (
            lambda c: c.call(
                "step",
                step_arrays([3], [[1]]),
                chunks=[{"slot": 1, "start": 0, "sample": True, "sampling": {}}],
            ),
            "slot 3 holds no sequence",
        ),
        (
            lambda c: c.call("step", step_arrays([], []), chunks=[{"slot": 1, "start": 0, "sample": "no"}]),
            "sample (true or false)",
        ),
        # Token masks (structured output): `masked` slots, then an int32 array [masked, words].
        (
            lambda c: c.call("step", [np.array([0], np.int32)], chunks=[], masked="x"),
            "must list distinct slot ids",
        ),
        (
            lambda c: c.call("step", [np.array([0], np.int32)], chunks=[], masked=[0, 0]),
            "must list distinct slot ids",
        ),
        (
            lambda c: c.call(
                "step", [np.array([0], np.int32), np.ones((1, 2), np.int64)], chunks=[], masked=[0]
            ),
            "an int32 array [masked slots, words]",
        ),
        (
            lambda c: c.call(
                "step",
                [
                    *step_arrays([], [])[:2],
                    np.array([1, 2], np.int32),
                    slot_blocks(0),
                    np.full((1, 2), -1, np.int32),
                ],
                chunks=[{"slot": 0, "start": 0, "sample": True, "sampling": {}}],
                masked=[1],
            ),
            "a token mask for slot 1, which samples nothing in this call",
        ),
        # These three killed the agent (TypeError, OverflowError, an int64 product that wrapped to 0).
        (lambda c: c.raw(spec_frames([["int32"], [1]], b"\x00" * 4)), "bad description"),
        (lambda c: c.raw(spec_frames(["int32", [float("inf")]], b"")), "bad shape"),
        (lambda c: c.raw(spec_frames(["int32", [2**32, 2**32]], b"")), "bad shape"),
        (lambda c: c.raw(spec_frames(["int32", [2**20, 2**20]], b"")), "is larger than"),
        (lambda c: c.raw(spec_frames(["int32", [-1]], b"")), "bad shape"),
        (lambda c: c.raw(spec_frames(["int32", [1] * 64], b"\x00" * 4)), "bad description"),
        (lambda c: c.raw(spec_frames("int32", b"")), "bad description"),
    ],
)
def test_bad_messages_get_error_replies_and_the_agent_keeps_serving(two_agents, frames_or_call, error):
    _, ports, _ = two_agents
    client = AgentSocket(ports[0])
    header, _ = frames_or_call(client)
    assert header["ok"] is False and error in header["error"], header
    assert client.call("ping")[0]["ok"]
    client.close()


def test_a_frame_over_the_largest_legal_one_is_dropped_unread(two_agents):
    """ZeroMQ MAXMSGSIZE from the largest legal frame (a mixed agent takes no K/V: tokens and headers
    only): a larger frame closes that connection before the agent holds it; no reply, no crash."""
    launcher, ports, _ = two_agents
    pids = launcher.agent_pids()
    limit = AgentSocket(ports[0]).call("info")[0]["max_frame_bytes"]
    assert limit == 16 * 64 + (1 << 20)  # max_seq_len 64
    oversized = AgentSocket(ports[0], session=False)
    tokens = np.zeros(limit // 4 + 1, np.int32)  # a well-formed step, one frame too large
    with pytest.raises(TimeoutError):
        oversized.raw(protocol.encode({"op": "step", "id": 1}, [tokens]), timeout=3)
    oversized.close()
    assert launcher.agent_pids() == pids and AgentSocket(ports[0]).call("ping")[0]["ok"]


def test_agents_survive_every_bad_message(two_agents):
    """Runs after the bad messages above: the same processes still serve (none died and was
    restarted by the launcher)."""
    launcher, ports, _ = two_agents
    assert sum("restarting" in line for line in launcher.lines) == 0
    assert all(AgentSocket(port).call("ping")[0]["ok"] for port in ports)


def test_slot_operations_need_the_current_session(two_agents):
    """A local process that never opened the session (or names another) can neither release nor
    decode the server's slots, nor stop the agent; the session holder's sequence is untouched."""
    _, ports, _ = two_agents
    owner = AgentSocket(ports[0])
    assert owner.prefill(2, [5, 6, 7])[0]["ok"]
    intruder = AgentSocket(ports[0], session=False)
    for op, arrays, fields in [
        ("release", (), {"slot": 2}),
        ("step", [np.array([2], np.int32), slot_blocks(2)[None]], {"chunks": []}),
        ("step", step_arrays([2], [[1]]), {"chunks": [{"slot": 3, "start": 0, "sample": True}]}),
        ("shutdown", (), {}),
    ]:
        header, _ = intruder.call(op, arrays, **fields)
        assert not header["ok"] and "needs the current session" in header["error"], header
        header, _ = intruder.call(op, arrays, session=owner.session + 1, **fields)
        assert not header["ok"] and header["kind"] == "stale_session", header
    header, arrays = owner.decode([2])
    assert header["ok"] and len(arrays[0]) == 1
    assert owner.call("release", slot=2)[0]["ok"] and owner.call("ping")[0]["ok"]


def test_version_mismatch_is_a_clear_error(two_agents):
    import msgpack

    _, ports, _ = two_agents
    client = AgentSocket(ports[1])
    header, _ = client.raw([msgpack.packb({"v": 999, "op": "ping", "id": 1, "arrays": []})])
    assert not header["ok"] and "protocol version mismatch: got 999" in header["error"]
    client.close()


def test_missing_model_file_fails_fast_naming_the_file(launch, tmp_path):
    missing = tmp_path / "no-such-model.gguf"
    launcher, _ = launch(missing, 2)
    assert launcher.process.wait(60) != 0
    assert "no-such-model.gguf" in launcher.output() and "failed to start" in launcher.output()
    assert launcher.agent_pids() == []


def test_sigterm_during_decode_exits_zero_with_no_agent_left(launch, tiny_llama_dir):
    launcher, ports = launch(tiny_llama_dir, 2)
    launcher.wait_for("all agents started", START_TIMEOUT)
    pids = launcher.agent_pids()
    assert len(pids) >= 2
    client = AgentSocket(ports[0])
    assert client.prefill(0, [5, 6, 7])[0]["ok"]
    stop = threading.Event()
    steps = [0]

    def keep_decoding():
        while not stop.is_set() and steps[0] < 50:
            try:
                client.decode([0], timeout=2)
            except TimeoutError:
                return
            steps[0] += 1

    worker = threading.Thread(target=keep_decoding)
    worker.start()
    wait_until(lambda: steps[0] >= 2, 30, "the agent decoding")
    launcher.process.send_signal(signal.SIGTERM)
    assert launcher.process.wait(15) == 0
    stop.set()
    worker.join(10)
    # Every agent ended on SIGTERM, its step in flight done: none outlived agents.shutdown_grace_s.
    assert "ignored SIGTERM" not in launcher.output() and "all agents stopped" in launcher.output()
    assert wait_gone(pids, 5) == []
    client.close()


def test_kill_9_of_the_launcher_takes_the_agents_down(launch, tiny_llama_dir):
    launcher, _ = launch(tiny_llama_dir, 1)
    launcher.wait_for("all agents started", START_TIMEOUT)
    pids = launcher.agent_pids()
    os.kill(launcher.process.pid, signal.SIGKILL)
    launcher.process.wait(5)
    assert wait_gone(pids, 10) == []


def test_killed_agent_is_restarted_by_policy(launch, tiny_llama_dir, tmp_path):
    launcher, ports = launch(tiny_llama_dir, 1, agents={"restart_policy": "restart"})
    first = launcher.wait_for("all agents started", START_TIMEOUT)
    agent_pid = next(p for p in launcher.agent_pids() if "spawn" in " ".join(psutil.Process(p).cmdline()))
    os.kill(agent_pid, signal.SIGKILL)
    launcher.wait_for("agent rank 0 died (exit code -9); restarting", 30, start=first)
    launcher.wait_for("agent rank 0 ready on", START_TIMEOUT, start=first + 1)
    assert not alive(agent_pid)
    client = AgentSocket(ports[0])
    assert client.call("ping", timeout=30)[0]["ok"]
    client.close()
    log = (tmp_path / "logs" / "agent_launcher.log").read_text()
    assert "agent rank 0 died (exit code -9); restarting (restart 1 of 3 within 600s)" in log


def test_killed_agent_with_exit_policy_stops_the_launcher(launch, tiny_llama_dir):
    launcher, _ = launch(tiny_llama_dir, 2, agents={"restart_policy": "exit"})
    launcher.wait_for("all agents started", START_TIMEOUT)
    pids = launcher.agent_pids()
    victim = next(p for p in pids if "spawn" in " ".join(psutil.Process(p).cmdline()))
    os.kill(victim, signal.SIGKILL)
    assert launcher.process.wait(30) == 1
    assert "restart policy is 'exit'" in launcher.output()
    assert wait_gone(pids, 5) == []


def test_curve_agent_serves_the_configured_server_key_only(launch, tiny_llama_dir):
    """An agent with agents.curve set accepts only a client holding the server keypair and pinning
    this agent's own public key: a plain client, a client with another keypair, and one that
    expects another agent's key get nothing back."""
    launcher, (port,) = launch(tiny_llama_dir, agents={"curve": curve_keys(1)})
    launcher.wait_for("all agents started", START_TIMEOUT)
    curve = load_config(launcher.config_path).agents.curve
    address = f"tcp://127.0.0.1:{port}"
    server = ClientKeys(*curve.server_keypair(), agent_public_key=curve.agents[0].public_key)

    async def info(keys) -> dict:
        # a refusal arrives as a handshake event within milliseconds; 3 s once passed without it on a
        # loaded CI machine, so the bound leaves room (it never decides a passing run's time)
        client = AgentClient(address, timeout_s=15, keys=keys)
        try:
            return await client.info()
        finally:
            client.close()

    assert asyncio.run(info(server))["num_slots"] == 4
    with pytest.raises(AgentUnavailable, match="refused the connection"):
        asyncio.run(info(None))
    intruder_public, intruder_secret = zmq.curve_keypair()
    with pytest.raises(AgentUnavailable, match="refused the connection"):
        asyncio.run(
            info(ClientKeys(intruder_public.decode(), intruder_secret.decode(), server.agent_public_key))
        )
    other_agent_public, _ = zmq.curve_keypair()  # a server that pins another agent's key
    with pytest.raises(AgentUnavailable, match="refused the connection"):
        asyncio.run(info(ClientKeys(server.public_key, server.secret_key, other_agent_public.decode())))
    assert (
        "refused a CURVE client with an unknown public key"
        in (launcher.config_path.parent / "logs" / "agent_0.log").read_text()
    )


def test_each_machine_needs_only_the_secret_of_what_it_runs(tmp_path, tiny_llama_dir):
    """A config copy without the server's secret cannot start the server, one without agent 0's
    secret cannot start agent 0: each exits at once naming the missing key."""
    curve = curve_keys(1)
    curve["server_secret_key"] = None
    curve["agents"][0]["secret_key"] = None
    path = write_config(tmp_path, tiny_llama_dir, free_ports(1), agents={"curve": curve})
    for script, message in (
        ("start_server.py", "agents.curve has no server_secret_key"),
        ("start_agent.py", "agents.curve.agents[0] has no secret_key"),
    ):
        done = subprocess.run(
            [sys.executable, script, "--config", str(path)],
            cwd=PROJECT_ROOT,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode != 0 and message in done.stdout + done.stderr, (script, done)


def test_agent_plans_its_block_pool_from_the_memory_budget_and_logs_the_plan(
    launch, tiny_llama_dir, tmp_path
):
    """A budget: the agent gives the KV pool what the weights and working memory leave, logs the
    plan, and reports the pool and the slots (num_slots: auto, the largest decode batch) to the
    server (info); a budget too small fails start-up naming the sizes."""
    runtime = {"num_slots": "auto", "memory_budget_mb": 2, "decode_batch_buckets": [1, 2, 4, 8]}
    launcher, ports = launch(tiny_llama_dir, runtime=runtime)
    launcher.wait_for("all agents started", START_TIMEOUT)
    log = (tmp_path / "logs" / "agent_0.log").read_text()
    plan = next(line for line in log.splitlines() if "memory plan:" in line)
    blocks = int(plan.split(" blocks of 16 positions")[0].rsplit(" ", 1)[1])
    assert "weights" in plan and "shared by 8 slots" in plan and "of a 2 MB budget" in plan
    info, _ = AgentSocket(ports[0]).call("info")
    assert (info["num_slots"], info["num_blocks"], info["block_size"]) == (8, blocks, 16)
    assert blocks > 8 * 64 // 16  # the tiny model's blocks are small: more than every slot's whole length
    launcher.close()

    failing, _ = launch(
        tiny_llama_dir,
        runtime={
            "num_slots": 4,
            "max_seq_len": 8192,
            "memory_budget_mb": 2,  # the weights and working memory (RoPE tables of 8192), not one sequence
            "attend_buckets": [8192],
        },
    )
    assert failing.process.wait(START_TIMEOUT) != 0
    assert "a pool needs at least 512 blocks (one sequence of max_seq_len 8192)" in failing.output()


def test_agents_run_on_their_configured_cpus(launch, tiny_llama_dir):
    """agents.cpu_affinity: each agent process (and so its MindSpore and kernel threads) stays on
    its CPUs; a CPU the machine lacks fails start-up naming it."""
    cpus = sorted(os.sched_getaffinity(0))
    sets = [[cpus[0]], [cpus[-1]]]
    launcher, _ = launch(tiny_llama_dir, 2, agents={"cpu_affinity": sets})
    launcher.wait_for("all agents started", START_TIMEOUT)
    pids = launcher.agent_pids()
    assert len(pids) == 2
    assert sorted(psutil.Process(pid).cpu_affinity() for pid in pids) == sorted(sets)
    launcher.close()

    failing, _ = launch(tiny_llama_dir, agents={"cpu_affinity": [[4096]]})
    assert failing.process.wait(START_TIMEOUT) != 0
    assert "cannot run agent rank 0 on CPUs [4096] (agents.cpu_affinity)" in failing.output()


def test_restart_budget_counts_crashes_within_its_window():
    budget = RestartBudget(limit=3, window_s=600)
    assert [budget.take(t) for t in (0, 10, 20, 30)] == [True, True, True, False]  # a crash loop stops
    daily = RestartBudget(limit=3, window_s=600)
    assert all(daily.take(day * 86400) for day in range(30))  # a crash a day never adds up
    assert budget.take(605) and not budget.take(606)  # the crash at 0 left the window, the others not
