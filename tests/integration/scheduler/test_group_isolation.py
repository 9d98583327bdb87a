"""Groups progress independently: with one agent stuck (its ZeroMQ I/O thread still answers the
heartbeats, but the call never returns), the other group's requests go on at full speed."""

import asyncio
import threading

import pytest
import zmq

from agent.contract.sampling import SamplingParams
from agent.model.tokenizer import load_tokenizer
from agent_harness import LauncherProcess, free_ports, write_config
from config import load_config
from engine_harness import EngineAndStreams

GREEDY = SamplingParams()
AGENT_TIMEOUT_S = 20


class StuckAgentProxy(threading.Thread):
    """Forwards between the server and an agent, and withholds the agent's replies while `stuck` is
    set. An agent stuck inside an op with its heartbeats still answered cannot be made from outside
    (SIGSTOP stops the heartbeats too): this proxy's own ZeroMQ I/O thread answers them."""

    def __init__(self, agent_port: int):
        super().__init__(daemon=True)
        context = zmq.Context.instance()
        self.front = context.socket(zmq.ROUTER)
        self.port = self.front.bind_to_random_port("tcp://127.0.0.1")
        self.back = context.socket(zmq.DEALER)
        self.back.connect(f"tcp://127.0.0.1:{agent_port}")
        self.stuck, self.done = threading.Event(), threading.Event()
        self.held: list[list[bytes]] = []
        self.peer = b""  # the server's connection (one at a time here)

    def run(self) -> None:
        poller = zmq.Poller()
        poller.register(self.front, zmq.POLLIN)
        poller.register(self.back, zmq.POLLIN)
        while not self.done.is_set():
            ready = dict(poller.poll(50))
            if self.front in ready:
                self.peer, *frames = self.front.recv_multipart()
                self.back.send_multipart(frames)
            if self.back in ready:
                self.held.append(self.back.recv_multipart())
            while self.held and not self.stuck.is_set():
                self.front.send_multipart([self.peer, *self.held.pop(0)])
        self.front.close(linger=0)
        self.back.close(linger=0)


@pytest.fixture(scope="module")
def groups(tmp_path_factory, tiny_llama_dir):
    ports = free_ports(2)
    launcher = LauncherProcess(write_config(tmp_path_factory.mktemp("agents"), tiny_llama_dir, ports))
    proxy = StuckAgentProxy(ports[1])
    proxy.start()
    try:
        launcher.wait_for("all agents started", 240)
        server_config = write_config(
            tmp_path_factory.mktemp("server"),
            tiny_llama_dir,
            [ports[0], proxy.port],
            server={"agent_timeout_s": AGENT_TIMEOUT_S},
        )
        yield load_config(server_config), proxy
    finally:
        proxy.done.set()
        proxy.join(5)
        launcher.close()


async def collect(stream):
    return [out async for out in stream]


def test_a_stuck_group_holds_only_its_own_requests(groups, tiny_llama_dir):
    config, proxy = groups
    tokenizer = load_tokenizer(tiny_llama_dir)
    prompt = tokenizer.encode("The quick brown")

    async def scenario():
        server = EngineAndStreams(config, tokenizer)
        await server.engine.start()
        healthy = server.generate_answer("healthy", prompt, GREEDY, 40, ignore_eos=True)
        stuck = server.generate_answer("stuck", prompt, GREEDY, 40, ignore_eos=True)
        first = [await healthy.__anext__(), await stuck.__anext__()]
        placed = tuple(server.engine.scheduler.running[r].group for r in ("healthy", "stuck"))
        proxy.stuck.set()
        # Hang guards only: what the test proves is the state asserted below.
        rest = await asyncio.wait_for(collect(healthy), 3 * AGENT_TIMEOUT_S)
        newcomer = await asyncio.wait_for(
            collect(server.generate_answer("new", prompt, GREEDY, 8, ignore_eos=True)), 3 * AGENT_TIMEOUT_S
        )
        # Both answered while the other group was still stuck: its request running, its reply held,
        # and the group not yet given up on (agent_timeout_s not reached).
        scheduler = server.engine.scheduler
        still_stuck = ("stuck" in scheduler.running, scheduler.healthy[1], len(proxy.held) > 0)
        proxy.stuck.clear()  # the agent answers again: its request goes on where it was
        stuck_rest = await asyncio.wait_for(collect(stuck), AGENT_TIMEOUT_S)
        await server.engine.stop()
        return placed, first + rest, newcomer, still_stuck, stuck_rest

    placed, healthy, newcomer, still_stuck, stuck_rest = asyncio.run(scenario())
    assert placed == (0, 1)
    assert healthy[-1].finish_reason == "length" and healthy[-1].index == 40
    assert newcomer[-1].finish_reason == "length" and newcomer[-1].index == 8
    assert still_stuck == (True, True, True), still_stuck
    assert stuck_rest[-1].finish_reason == "length" and stuck_rest[-1].error is None
