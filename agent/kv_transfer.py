"""KVSender: a prefill agent's side of PD disaggregation. It sends a slot's K/V straight to a
decode agent (a DEALER per decode agent, kept open; the K/V go as one raw frame, no pickle, no copy
through the server) and waits for that agent's acknowledgement.

    sender = KVSender(keys, timeout_s)   # keys: decode agent address -> ClientKeys, None without CURVE
    transfer_ms = sender.send(address, fields, arrays)   # K/V and the decode agent's block table

A transfer that fails or times out closes that connection with linger 0, so nothing still queued
for it is delivered later; the scheduler then cancels the transfer's ticket at the decode agent, so
a copy already on its way is refused there too.
"""

from __future__ import annotations

import itertools
import logging
import time

import numpy as np
import zmq

from agent.contract import protocol
from agent.contract.transport import ClientKeys, secure_client_socket

log = logging.getLogger(__name__)

# A decode agent answers a transfer with a header only: a larger frame on this socket is no reply.
LARGEST_REPLY_BYTES = 1 << 20


class TransferError(Exception):
    """The K/V did not reach the decode agent (dead, hung, refused); the message says which."""


class KVSender:
    def __init__(self, keys: dict[str, ClientKeys] | None, timeout_s: float):
        self.keys = keys
        self.timeout_s = timeout_s
        self.context: zmq.Context = zmq.Context.instance()
        self._sockets: dict[str, zmq.Socket] = {}
        self._ids = itertools.count(1)

    def send(self, address: str, fields: dict, arrays: list[np.ndarray]) -> float:
        """kv_receive to `address` with `fields` (slot, session, ticket, state) and `arrays` (K/V,
        block table); returns the time until the decode agent acknowledged, in ms. Raises
        TransferError; never hangs."""
        socket = self._socket(address)
        request_id = next(self._ids)
        start = time.perf_counter()
        socket.send_multipart(
            protocol.encode({"op": "kv_receive", "id": request_id, **fields}, arrays), copy=False
        )
        deadline = time.monotonic() + self.timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not socket.poll(int(left * 1000)):
                self._drop(address)
                raise TransferError(
                    f"the decode agent at {address} did not acknowledge the KV within {self.timeout_s:g}s"
                )
            try:
                header, _ = protocol.decode(socket.recv_multipart())
            except protocol.ProtocolError as exc:
                self._drop(address)
                raise TransferError(f"the decode agent at {address} answered badly: {exc}") from exc
            if header.get("id") == request_id:
                break  # anything else answers a transfer that already timed out
        if not header.get("ok"):
            raise TransferError(f"the decode agent at {address} refused the KV: {header.get('error')}")
        return (time.perf_counter() - start) * 1000

    def _socket(self, address: str) -> zmq.Socket:
        socket = self._sockets.get(address)
        if socket is None:
            keys = None if self.keys is None else self.keys.get(address)
            if self.keys is not None and keys is None:
                raise TransferError(f"{address} is not a decode agent of this config (agents.curve)")
            socket = self.context.socket(zmq.DEALER)
            socket.setsockopt(zmq.LINGER, 0)
            socket.setsockopt(zmq.MAXMSGSIZE, LARGEST_REPLY_BYTES)
            if keys is not None:
                secure_client_socket(socket, keys)
            socket.connect(address)
            self._sockets[address] = socket
        return socket

    def _drop(self, address: str) -> None:
        socket = self._sockets.pop(address, None)
        if socket is not None:
            socket.close(linger=0)

    def close(self) -> None:
        for address in list(self._sockets):
            self._drop(address)
