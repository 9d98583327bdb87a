"""AgentClient: the server side of one agent's ZeroMQ socket (zmq.asyncio DEALER).

Every call has a timeout. A reply is matched to its request by id, so a late reply to a call that
timed out is dropped instead of being taken for the next call's answer.
"""
from __future__ import annotations

import asyncio
import itertools
import time
from typing import Any, Sequence

import numpy as np
import zmq
import zmq.asyncio

from agent import protocol
from agent.sampling import SamplingParams


class AgentError(Exception):
    """An agent call failed."""


class AgentUnavailable(AgentError):
    """No (valid) answer in time: the agent is dead, hung or speaks another protocol."""


class AgentRequestError(AgentError):
    """The agent answered with an error reply."""

    def __init__(self, message: str, kind: str):
        super().__init__(message)
        self.kind = kind


class AgentClient:
    def __init__(self, address: str, timeout_s: float, context: zmq.asyncio.Context | None = None):
        self.address = address
        self.timeout_s = timeout_s
        self.socket = (context or zmq.asyncio.Context.instance()).socket(zmq.DEALER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.connect(address)
        self._ids = itertools.count(1)
        self._lock = asyncio.Lock()  # one call in flight per agent

    async def call(self, op: str, arrays: Sequence[np.ndarray] = (), timeout_s: float | None = None,
                   **fields: Any) -> tuple[dict, list[np.ndarray]]:
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        async with self._lock:
            request_id = next(self._ids)
            await self.socket.send_multipart(protocol.encode({"op": op, "id": request_id, **fields},
                                                             arrays), copy=False)
            deadline = time.monotonic() + timeout_s
            while True:
                left = deadline - time.monotonic()
                if left <= 0 or not await self.socket.poll(int(left * 1000), zmq.POLLIN):
                    raise AgentUnavailable(f"agent {self.address}: no reply to {op} "
                                           f"within {timeout_s:g}s")
                try:
                    header, out = protocol.decode(await self.socket.recv_multipart())
                except protocol.ProtocolError as exc:
                    raise AgentUnavailable(f"agent {self.address}: {exc}") from exc
                if header.get("id") == request_id:
                    break  # anything else is a late answer to an earlier call that timed out
        if not header.get("ok"):
            raise AgentRequestError(f"agent {self.address}: {header.get('error')}",
                                    header.get("kind", "bad_request"))
        return header, out

    async def info(self) -> dict:
        header, _ = await self.call("info")
        if header.get("protocol") != protocol.PROTOCOL_VERSION:
            raise AgentUnavailable(f"agent {self.address} speaks protocol {header.get('protocol')}, "
                                   f"this server {protocol.PROTOCOL_VERSION}")
        return header

    async def prefill(self, slot: int, prompt: Sequence[int], sampling: SamplingParams) -> int:
        header, _ = await self.call("prefill", [np.asarray(prompt, np.int32)], slot=slot,
                                    sampling=sampling.model_dump())
        return int(header["token"])

    async def decode(self, slots: Sequence[int]) -> list[int]:
        _, arrays = await self.call("decode", [np.asarray(slots, np.int32)])
        return arrays[0].tolist()

    async def release(self, slot: int) -> None:
        await self.call("release", slot=slot)

    async def ping(self, timeout_s: float | None = None) -> None:
        await self.call("ping", timeout_s=timeout_s)

    def close(self) -> None:
        self.socket.close(linger=0)
