"""AgentClient (zmq.asyncio) against a real agent process: calls, error replies, timeouts."""

import asyncio
import os
import signal
import socket

import numpy as np
import pytest
import zmq
import zmq.asyncio

from agent.contract import protocol
from agent.contract.sampling import NO_TOKEN, Sampled, SamplingParams
from agent.contract.step import StepChunk, StepRequest
from agent.contract.step_reply import sampled_from_wire
from agent.model.tokenizer import load_tokenizer
from agent_harness import LauncherProcess, free_ports, slot_blocks, write_config
from scheduler.agent_client import AgentClient, AgentRequestError, AgentUnavailable, GroupClient


async def prefill(client, chunk: StepChunk, mask: np.ndarray | None = None) -> Sampled | None:
    """The chunk alone, as one step: its first token where it samples."""
    masks = {} if mask is None else {chunk.slot: mask}
    return (await client.step(StepRequest(chunks=[chunk], masks=masks))).firsts[0]


async def decode(client, slots: list[int], tables) -> list[Sampled]:
    """A decode of the slots alone, as one step: each slot's token."""
    return [tokens[0] for tokens in (await client.step(StepRequest(slots, tables))).decoded]


@pytest.fixture(scope="module")
def agent(tmp_path_factory, tiny_llama_dir):
    port = free_ports(1)[0]
    launcher = LauncherProcess(write_config(tmp_path_factory.mktemp("client"), tiny_llama_dir, [port]))
    try:
        launcher.wait_for("all agents started", 240)
        (pid,) = launcher.agent_pids()  # the one agent (the resource tracker is left out)
        yield f"tcp://127.0.0.1:{port}", pid
    finally:
        launcher.close()


def test_calls_match_the_in_process_runner(agent, tiny_llama_runner, tiny_llama_dir, release_all):
    address, _ = agent
    release_all(tiny_llama_runner)
    prompts = [load_tokenizer(tiny_llama_dir).encode(t) for t in ["The quick brown", "你好"]]
    # Slot 1 asks for logprobs: they travel beside its tokens, slot 0's replies carry none.
    params = [SamplingParams(), SamplingParams(logprobs=3)]
    runner = tiny_llama_runner
    want = []
    for slot, prompt in enumerate(prompts):
        want.append(
            runner.execute(StepRequest(chunks=[StepChunk(slot, prompt, None, 0, params[slot])])).firsts
        )
    for _ in range(5):
        for seq, (sampled,) in zip(want, runner.execute(StepRequest(slots=[0, 1])).decoded):
            seq.append(sampled)

    async def run():
        client = AgentClient(address, timeout_s=30)
        info = await client.info()
        await client.reset()
        tables = [slot_blocks(0), slot_blocks(1)]
        got = [
            [await prefill(client, StepChunk(s, p, tables[s], 0, params[s]))] for s, p in enumerate(prompts)
        ]
        for _ in range(5):
            for seq, token in zip(got, await decode(client, [0, 1], tables)):
                seq.append(token)
        await client.release(0)
        await client.release(1)
        client.close()
        return info, got

    info, got = asyncio.run(run())
    assert info["num_slots"] == 4 and got == want
    assert all(t.logprob is None for t in got[0]) and all(len(t.logprob.top) == 3 for t in got[1])


def test_error_reply_raises_with_the_agents_message(agent):
    async def run():
        client = AgentClient(agent[0], timeout_s=30)
        try:
            await client.reset()
            await decode(client, [3], [slot_blocks(3)])
        finally:
            client.close()

    with pytest.raises(AgentRequestError, match="slot 3 holds no sequence"):
        asyncio.run(run())


def only(tokens: list[int], vocab: int) -> np.ndarray:
    """A token mask (int32 words) allowing just `tokens`."""
    mask = np.zeros((vocab + 31) // 32, np.uint32)
    for token in tokens:
        mask[token // 32] |= np.uint32(1 << (token % 32))
    return mask.view(np.int32)


def test_a_choice_that_fails_is_its_sequences_error_and_the_call_goes_on(agent):
    """A sequence whose mask allows only EOS while min_tokens keeps EOS out has nothing to sample:
    its token is that sequence's fault on the wire, in a prefill and in a mixed step's chunk,
    while the step's decode row gets its token and decodes on; the faulted slot decodes no more.
    A reply value that is not a token id or a logprob is the fault of its sequence only."""
    address, _ = agent

    async def run():
        client = AgentClient(address, timeout_s=30)
        info = await client.info()
        await client.reset()
        vocab, (eos, *_) = info["vocab_size"], info["eos_ids"]
        starved = SamplingParams(min_tokens=3)
        try:
            first = await prefill(
                client, StepChunk(1, [5, 6, 7], slot_blocks(1), 0, starved), only([eos], vocab)
            )
            fine = await prefill(client, StepChunk(0, [5, 6, 7], slot_blocks(0), 0, SamplingParams()))
            chunk = StepChunk(2, [8, 9], slot_blocks(2), 0, starved)
            reply = await client.step(StepRequest([0], [slot_blocks(0)], [chunk], {2: only([eos], vocab)}))
            decoded, (chunk_first,) = reply.decoded, reply.firsts
            with pytest.raises(AgentRequestError, match="ended with an error"):
                await decode(client, [1], [slot_blocks(1)])
            again = await decode(client, [0], [slot_blocks(0)])
            malformed = [
                sampled_from_wire(vocab + 5, None, None, vocab, client.address),
                sampled_from_wire(3, [float("nan"), []], None, vocab, client.address),
            ]
            return first, fine, decoded, chunk_first, again, malformed
        finally:
            for slot in range(3):
                await client.release(slot)
            client.close()

    first, fine, decoded, chunk_first, again, malformed = asyncio.run(run())
    for faulted in (first, chunk_first):
        assert faulted.token == NO_TOKEN and faulted.fault.kind == "request"
        assert "min_tokens" in faulted.fault.message
    assert fine.fault is None and decoded[0][0].fault is None and again[0].fault is None
    assert all(m.token == NO_TOKEN and m.fault.kind == "internal" for m in malformed), malformed


def test_hung_agent_times_out_and_a_late_reply_is_not_mistaken(agent):
    address, pid = agent

    async def run():
        client = AgentClient(address, timeout_s=1.0)
        os.kill(pid, signal.SIGSTOP)
        try:
            with pytest.raises(AgentUnavailable, match="no reply to ping within 1s"):
                await client.ping()
        finally:
            os.kill(pid, signal.SIGCONT)
        # The agent now answers the stale ping first; the client must wait for this call's reply.
        header, _ = await client.call("info")
        assert header["op"] == "info"
        client.close()

    asyncio.run(run())


def test_a_second_session_takes_over_and_the_first_is_refused(agent, tiny_llama_dir):
    """A request still queued from a connection the server gave up on can never touch the slots
    of the connection that replaced it."""
    prompt = load_tokenizer(tiny_llama_dir).encode("The quick brown")

    async def run():
        old, new = AgentClient(agent[0], timeout_s=30), AgentClient(agent[0], timeout_s=30)
        try:
            await old.reset()
            await prefill(old, StepChunk(0, prompt, slot_blocks(0), 0, SamplingParams()))
            await new.reset()  # releases slot 0
            await prefill(new, StepChunk(0, prompt, slot_blocks(0), 0, SamplingParams()))
            with pytest.raises(AgentUnavailable, match="another server took this agent over"):
                await decode(old, [0], [slot_blocks(0)])
            assert len(await decode(new, [0], [slot_blocks(0)])) == 1
            await new.release(0)
        finally:
            old.close()
            new.close()

    asyncio.run(run())


class SilentAgent:
    """A ROUTER socket that takes requests and answers only when told: an agent whose op never
    returns while its ZeroMQ I/O thread still answers heartbeats, which a real agent cannot be made
    to do from outside (SIGSTOP stops its heartbeats too)."""

    def __init__(self):
        self.socket = zmq.asyncio.Context.instance().socket(zmq.ROUTER)
        self.socket.setsockopt(zmq.LINGER, 0)
        port = self.socket.bind_to_random_port("tcp://127.0.0.1")
        self.address = f"tcp://127.0.0.1:{port}"

    async def received(self, timeout_s: float) -> list[dict]:
        """The request headers that arrive within `timeout_s`."""
        headers = []
        while await self.socket.poll(int(timeout_s * 1000)):
            frames = await self.socket.recv_multipart()
            headers.append(protocol.decode(frames[1:])[0])
            timeout_s = 0.05
        return headers

    async def answer_all(self) -> None:
        """Answer every request (ok, no fields) until cancelled."""
        while True:
            frames = await self.socket.recv_multipart()
            header, _ = protocol.decode(frames[1:])
            await self.socket.send_multipart([frames[0], *protocol.ok_reply(header, {}, [])])

    def close(self) -> None:
        self.socket.close(linger=0)


def test_reconnect_while_a_call_polls_ends_that_call_cleanly():
    async def run():
        agent = SilentAgent()
        client = AgentClient(agent.address, timeout_s=30)
        try:
            call = asyncio.create_task(client.ping())
            assert [h["op"] for h in await agent.received(10)] == ["ping"]  # its reply now awaited
            client.reconnect()
            # ended by the reconnect, not by its own timeout ("no reply to ping within 30s")
            with pytest.raises(AgentUnavailable, match="reconnected"):
                await call
            answering = asyncio.create_task(agent.answer_all())
            await client.ping(5)  # the fresh connection works
            answering.cancel()
        finally:
            client.close()
            agent.close()

    asyncio.run(run())


def test_calls_to_a_port_that_never_completes_the_connection_end_at_their_timeout():
    """A port that accepts TCP but never speaks ZeroMQ: each request queues on the connecting socket,
    and past its high-water mark (1000) a send waits for room that never comes; every call still
    ends at its timeout (the send used to wait outside it, forever)."""
    listener = socket.create_server(("127.0.0.1", 0))

    async def run():
        client = AgentClient(f"tcp://127.0.0.1:{listener.getsockname()[1]}", timeout_s=0.005)
        try:
            for _ in range(1010):
                with pytest.raises(AgentUnavailable, match="no reply to ping within 0.005s"):
                    await client.ping()
        finally:
            client.close()

    try:
        asyncio.run(run())
    finally:
        listener.close()


def test_a_tensor_parallel_group_with_a_lost_rank_sends_nothing_to_the_others():
    """A call that reached only some ranks would leave them waiting in the AllReduce forever."""

    async def run():
        rank0, rank1 = SilentAgent(), SilentAgent()
        group = GroupClient(
            [AgentClient(rank0.address, timeout_s=5), AgentClient(rank1.address, timeout_s=5)]
        )
        try:
            answering = [asyncio.create_task(rank.answer_all()) for rank in (rank0, rank1)]
            for client in group.clients:  # both connected: each has answered
                await client.ping(5)
            for task in answering:
                task.cancel()
            rank1.close()  # rank 1's agent dies: its client learns it on its next call
            with pytest.raises(AgentUnavailable, match="connection lost"):
                await group.clients[1].ping()
            with pytest.raises(AgentUnavailable, match="connection lost"):
                await decode(group, [0], [slot_blocks(0)])
            assert await rank0.received(0.5) == []
        finally:
            group.close()
            rank0.close()

    asyncio.run(run())
