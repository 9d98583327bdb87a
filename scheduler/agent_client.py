"""AgentClient: the server side of one agent's ZeroMQ socket (zmq.asyncio DEALER).

Every call has a timeout. A reply is matched to its request by id, so a late reply to a call that
timed out is dropped instead of being taken for the next call's answer. A lost connection fails
the call in flight at once: a killed agent's socket closes, and ZeroMQ heartbeats notice an agent
that stopped answering (SIGSTOP, a dead machine) within HEARTBEAT_TIMEOUT_MS. After a failure the
client stays failed until `reconnect()`, which opens a fresh socket (nothing queued for the old
connection is ever delivered) and a fresh session; a call still waiting on the old socket then
ends with AgentUnavailable (that call closes it). A refused session (`stale_session`) on the current
connection raises AgentTakenOver: another server opened its own session on the agent.
"""

from __future__ import annotations

import asyncio
import itertools
import random
import time
from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from agent.contract import protocol
from agent.contract.step import StepRequest
from agent.contract.step_reply import StepReply, TierReport
from agent.contract.transport import ClientKeys, secure_client_socket

HEARTBEAT_IVL_MS = 1000
HEARTBEAT_TIMEOUT_MS = 3000
RETIRED_CHECK_S = 0.2  # how soon a call waiting on a connection that reconnect() replaced ends
HANDSHAKE_FAILED = (
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
)


class AgentError(Exception):
    """An agent call failed."""


class AgentUnavailable(AgentError):
    """No (valid) answer in time: the agent is dead, hung or speaks another protocol."""


class AgentIncompatible(AgentError):
    """The agent answers but cannot serve with this server (protocol or model mismatch)."""


class AgentRequestError(AgentError):
    """The agent answered with an error reply."""

    def __init__(self, message: str, kind: str):
        super().__init__(message)
        self.kind = kind


class ModelClient(Protocol):
    """What the engine calls on a group's client, whichever it is: an AgentClient (one agent) or a
    GroupClient (a tensor-parallel group). Only an AgentClient takes a step with a KV transfer: a
    prefill group is one agent (the config makes tensor-parallel groups mixed)."""

    @property
    def address(self) -> str: ...

    @property
    def session(self) -> int: ...

    @property
    def lost(self) -> str | None: ...

    @property
    def decode_compute_s(self) -> float: ...

    def reconnect(self) -> None: ...

    def close(self) -> None: ...

    async def info(self, timeout_s: float | None = None) -> dict: ...

    async def reset(self, timeout_s: float | None = None) -> None: ...

    async def step(self, request: StepRequest) -> StepReply: ...

    async def release(self, slot: int, ticket: int | None = None) -> None: ...

    async def ping(self, timeout_s: float | None = None) -> None: ...

    async def drop_cache(self) -> tuple[int, TierReport | None]: ...


class AgentTakenOver(AgentUnavailable):
    """The agent refused this client's current session: another server opened its own (the newer
    one wins; this one must leave the agent alone)."""


class _Connection:
    """One socket to the agent and the session opened over it. reconnect() retires it for a fresh
    one: a call in flight on it (the only one that may still use it) ends and closes it."""

    def __init__(self, context: zmq.asyncio.Context, address: str, keys: ClientKeys | None):
        self.socket = context.socket(zmq.DEALER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_IVL_MS)
        self.socket.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)
        if keys is not None:
            secure_client_socket(self.socket, keys)
        self.monitor = self.socket.get_monitor_socket(zmq.EVENT_DISCONNECTED | HANDSHAKE_FAILED)
        self.poller = zmq.asyncio.Poller()
        self.poller.register(self.socket, zmq.POLLIN)
        self.poller.register(self.monitor, zmq.POLLIN)
        self.socket.connect(address)
        self.session = random.getrandbits(62)
        self.lock = asyncio.Lock()  # one call in flight per connection
        self.lost: str | None = None  # why the connection is unusable, until reconnect()
        self.retired = False

    def retire(self) -> None:
        """Closed now if no call uses it, else by that call once it wakes (closing a socket under
        a pending poll would cancel the caller's await from inside)."""
        self.retired = True
        if not self.lock.locked():
            self.close()

    def close(self) -> None:
        if self.socket.closed:
            return
        self.socket.disable_monitor()
        self.monitor.close(linger=0)
        self.socket.close(linger=0)


class AgentClient:
    def __init__(
        self,
        address: str,
        timeout_s: float,
        keys: ClientKeys | None = None,
        context: zmq.asyncio.Context | None = None,
        epoch: int | None = None,
    ):
        self.address = address
        self.timeout_s = timeout_s
        self.keys = keys  # CURVE: this server's keypair and the agent's public key
        self.context = context or zmq.asyncio.Context.instance()
        self._ids = itertools.count(1)
        self._connection = _Connection(self.context, address, keys)
        # When this server started: an agent lets a newer server take it over, never an older one.
        self.epoch = epoch if epoch is not None else time.time_ns()
        self.decode_compute_s = 0.0  # the last decode's time inside the agent, by its own clock
        self.vocab_size: int | None = None  # the agent's (info): every token it sends lies below

    @property
    def session(self) -> int:
        return self._connection.session

    @property
    def lost(self) -> str | None:
        return self._connection.lost

    def reconnect(self) -> None:
        self._connection.retire()
        self._connection = _Connection(self.context, self.address, self.keys)

    async def call(
        self, op: str, arrays: Sequence[np.ndarray] = (), timeout_s: float | None = None, **fields: Any
    ) -> tuple[dict, list[np.ndarray]]:
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        connection = self._connection
        async with connection.lock:
            try:
                header, out = await self._exchange(connection, op, arrays, timeout_s, fields)
            finally:
                if connection.retired:
                    connection.close()
        if not header.get("ok"):
            if header.get("kind") == "stale_session":
                connection.lost = "another server took this agent over"
                raise AgentTakenOver(f"agent {self.address}: {connection.lost}")
            raise AgentRequestError(
                f"agent {self.address}: {header.get('error')}", header.get("kind", "bad_request")
            )
        return header, out

    async def _exchange(
        self, connection: _Connection, op: str, arrays: Sequence[np.ndarray], timeout_s: float, fields: dict
    ) -> tuple[dict, list[np.ndarray]]:
        """Send one request and wait for its reply (header, arrays) on `connection`."""
        if connection.retired:  # queued behind a call on a connection replaced meanwhile
            raise AgentUnavailable(f"agent {self.address}: reconnected before {op} was sent")
        if connection.lost:
            raise AgentUnavailable(f"agent {self.address}: {connection.lost}")
        request_id = next(self._ids)
        try:
            frames = protocol.encode({"op": op, "id": request_id, **fields}, arrays)
        except (TypeError, ValueError, OverflowError) as exc:  # a field msgpack cannot carry
            raise AgentRequestError(f"{op}: cannot encode the request: {exc}", "bad_request") from exc
        try:
            # The whole exchange within the timeout, the send too: to a peer that never completes the
            # connection, requests queue until the high-water mark (1000), then a send waits forever.
            async with asyncio.timeout(timeout_s):
                return await self._reply(connection, op, request_id, frames)
        except TimeoutError:
            raise AgentUnavailable(f"agent {self.address}: no reply to {op} within {timeout_s:g}s") from None

    async def _reply(
        self, connection: _Connection, op: str, request_id: int, frames: list
    ) -> tuple[dict, list[np.ndarray]]:
        """Send the request and wait for its reply (the caller bounds the wait)."""
        await connection.socket.send_multipart(frames, copy=False)
        while True:
            # In slices, so that a reconnect() ends this wait soon instead of at the timeout.
            ready = dict(await connection.poller.poll(int(RETIRED_CHECK_S * 1000)))
            if connection.retired:
                raise AgentUnavailable(f"agent {self.address}: reconnected during {op}")
            if connection.monitor in ready:
                connection.lost = self._why_lost(await connection.monitor.recv_multipart())
                raise AgentUnavailable(f"agent {self.address}: {connection.lost} during {op}")
            if connection.socket not in ready:
                continue
            try:
                header, out = protocol.decode(await connection.socket.recv_multipart())
            except protocol.ProtocolError as exc:
                raise AgentUnavailable(f"agent {self.address}: {exc}") from exc
            if header.get("id") == request_id:
                return header, out
            # anything else is a late answer to an earlier call that timed out

    @staticmethod
    def _why_lost(monitor_frames: list) -> str:
        if parse_monitor_message(monitor_frames)["event"] == zmq.EVENT_DISCONNECTED:
            return "connection lost (the agent died or stopped answering heartbeats)"
        return (
            "the agent refused the connection (ZeroMQ handshake failed: "
            "do agents.curve keys match on both sides?)"
        )

    async def info(self, timeout_s: float | None = None) -> dict:
        header, _ = await self.call("info", timeout_s=timeout_s)
        if header.get("protocol") != protocol.PROTOCOL_VERSION:
            raise AgentIncompatible(
                f"agent {self.address} speaks protocol {header.get('protocol')}, "
                f"this server {protocol.PROTOCOL_VERSION}"
            )
        vocab = header.get("vocab_size")
        self.vocab_size = vocab if type(vocab) is int and vocab > 0 else None
        return header

    async def reset(self, timeout_s: float | None = None) -> None:
        """Open this client's session on the agent: every slot is released."""
        await self.call("reset", timeout_s=timeout_s, session=self.session, epoch=self.epoch)

    async def step(self, request: StepRequest) -> StepReply:
        """One agent step (agent/contract/step.py): each decode slot's tokens (one; with drafts,
        the proposals the agent kept and one more) and each chunk's first token (None unless it
        samples); with a transfer, the K/V bytes sent and how long that took."""
        fields, arrays = request.to_wire()
        header, out = await self.call("step", arrays, **fields, session=self.session)
        self.decode_compute_s = float(header.get("compute_ms", 0.0)) / 1000
        try:
            return StepReply.from_wire(header, out, request, self.vocab_size, f"agent {self.address}")
        except ValueError as exc:
            raise AgentUnavailable(f"agent {self.address}: {exc}") from exc

    async def release(self, slot: int, ticket: int | None = None) -> None:
        """ticket: a KV transfer into this slot that is given up; the agent refuses it from now on."""
        fields: dict[str, Any] = {} if ticket is None else {"ticket": ticket}
        await self.call("release", slot=slot, session=self.session, **fields)

    async def ping(self, timeout_s: float | None = None) -> None:
        await self.call("ping", timeout_s=timeout_s)

    async def drop_cache(self) -> tuple[int, TierReport | None]:
        """Empty the agent's KV tier: the blocks it held, and its report after (None: it keeps none)."""
        header, _ = await self.call("drop_cache", session=self.session)
        dropped = header.get("tier_blocks")
        try:
            if type(dropped) is not int or dropped < 0:
                raise ValueError(f"tier_blocks is {dropped!r:.40}, not a count")
            return dropped, None if header.get("tier") is None else TierReport.from_wire(header["tier"])
        except ValueError as exc:
            raise AgentUnavailable(f"agent {self.address}: drop_cache: {exc}") from exc

    def close(self) -> None:
        self._connection.retire()


class GroupClient:
    """The agents of one tensor-parallel group as one client. Every call goes to all ranks at once
    (the collectives inside their graphs need each of them); rank 0's answer is the group's, and
    the ranks must agree. The first rank that fails fails the call at once."""

    def __init__(self, clients: list[AgentClient]):
        self.clients = clients
        self.address = ",".join(c.address for c in clients)

    @property
    def session(self) -> int:
        return self.clients[0].session

    @property
    def lost(self) -> str | None:
        return next((c.lost for c in self.clients if c.lost), None)

    @property
    def decode_compute_s(self) -> float:
        return max(c.decode_compute_s for c in self.clients)  # the ranks step together

    def reconnect(self) -> None:
        for client in self.clients:
            client.reconnect()

    def close(self) -> None:
        for client in self.clients:
            client.close()

    async def _all(self, method: str, *args, **kwargs) -> list:
        if self.lost:  # before any rank is sent to: the others would wait in their AllReduce forever
            raise AgentUnavailable(f"tensor-parallel group {self.address}: {self.lost}")
        tasks = [asyncio.ensure_future(getattr(c, method)(*args, **kwargs)) for c in self.clients]
        done, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        for task in tasks:
            if task.done() and not task.cancelled() and task.exception() is not None:
                raise task.exception()
        return [task.result() for task in tasks]

    async def _agreed(self, method: str, *args, **kwargs):
        """Rank 0's result, once every rank chose the same tokens (their logprobs may differ in
        the last bits: only rank 0's are used)."""
        results = await self._all(method, *args, **kwargs)
        if any(_tokens_of(r) != _tokens_of(results[0]) for r in results[1:]):
            raise AgentUnavailable(
                f"tensor-parallel group {self.address}: the ranks disagree on {method} ({results})"
            )
        return results[0]

    async def info(self, timeout_s: float | None = None) -> dict:
        return (await self._all("info", timeout_s))[0]

    async def reset(self, timeout_s: float | None = None) -> None:
        await self._all("reset", timeout_s)

    async def step(self, request: StepRequest) -> StepReply:
        return await self._agreed("step", request)

    async def release(self, slot: int, ticket: int | None = None) -> None:
        await self._all("release", slot, ticket)

    async def ping(self, timeout_s: float | None = None) -> None:
        await self._all("ping", timeout_s)

    async def drop_cache(self) -> tuple[int, TierReport | None]:
        return (await self._all("drop_cache"))[0]


def _tokens_of(reply: StepReply) -> list:
    """The token ids of a step's reply."""
    firsts = [None if s is None else s.token for s in reply.firsts]
    return [[s.token for s in slot] for slot in reply.decoded] + firsts
