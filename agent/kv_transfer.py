"""KV transfer between agents (PD disaggregation): a prefilled slot's K/V, its Gated DeltaNet states
(a hybrid model's: Qwen3.5's) and sampling state out of one runner and into another's slot and
blocks, and the prefill agent's sender.

    blocks, states, state = export_kv(runner, slot)  # prefill agent: K/V [2 * layers, KV, n, hd], states
    import_kv(other, slot2, blocks, state, table, states)  # decode agent: written in the graphs

KVSender is a prefill agent's side of it. It sends a slot's K/V straight to a
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
from agent.graphs.interface import bucket
from agent.runner import BlockTable, ModelRunner, RunnerError, SlotState
from agent.sampling import SlotSampler

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


def export_kv(runner: ModelRunner, slot: int) -> tuple[np.ndarray, list[np.ndarray], dict]:
    """A just-prefilled slot's K/V [2 * layers with a KV cache, KV heads, length, row width] (K then
    V of each), its Gated DeltaNet states (KVTransferGraphs.state_export: none without such layers),
    and the state that goes with them (length, pending token, sampler)."""
    state = runner.active(slot)
    if state.sampler is None or state.next_token is None:
        raise RunnerError(f"slot {slot} has not finished its prompt")
    _check_transfer(runner, state.length)
    pieces = [
        runner.kv_graphs().kv_export(sub_table, size)[:, :, :n]
        for sub_table, n, size in _transfer_pieces(runner, state.table, state.length)
    ]
    return (
        np.ascontiguousarray(np.concatenate(pieces, axis=2)),
        runner.kv_graphs().state_export(slot),
        {"length": state.length, "next_token": state.next_token, "sampler": state.sampler.state()},
    )


def import_kv(
    runner: ModelRunner,
    slot: int,
    blocks: np.ndarray,
    state: dict,
    table: BlockTable | None = None,
    states: list[np.ndarray] | None = None,
) -> None:
    """Another agent's export_kv into a free slot and the blocks of `table`, which then
    decodes as if prefilled here."""
    runner.slot_table.check_slot(slot)
    if slot in runner.slots:
        raise RunnerError(f"slot {slot} is in use; release it first")
    length, next_token = state.get("length"), state.get("next_token")
    if type(length) is not int or type(next_token) is not int:  # not a bool, nor a float
        raise RunnerError("the KV state needs integer length and next_token")
    _check_transfer(runner, length)
    shape = (
        2 * runner.spec.attention_layers,
        runner.graphs.inputs.kv_heads,
        length,
        runner.cache_row_width(),
    )
    if blocks.shape != shape or blocks.dtype != runner.cache_dtype():
        raise RunnerError(
            f"KV blocks of {blocks.dtype}{list(blocks.shape)} do not fit this "
            f"model's cache ({np.dtype(runner.cache_dtype()).name}{list(shape)})"
        )
    if not 0 <= next_token < runner.spec.vocab_size:
        raise RunnerError(f"next_token {next_token} is outside the vocabulary")
    sampler_state = state.get("sampler")
    if not isinstance(sampler_state, dict):
        raise RunnerError("the KV state needs a sampler map")
    try:
        sampler = SlotSampler.from_state(sampler_state, runner.spec.vocab_size, runner.spec.eos_ids)
    except ValueError as exc:
        raise RunnerError(f"the KV state's sampler is refused: {exc}") from exc
    states = states or []
    expected = state_shapes(runner)
    if [s.shape for s in states] != expected or any(s.dtype != np.float32 for s in states):
        raise RunnerError(
            f"Gated DeltaNet states {[f'{s.dtype}{list(s.shape)}' for s in states]} do not fit this "
            f"model's ({[f'float32{list(e)}' for e in expected]})"
        )
    padded_table = runner.padded_table(slot, table, length + 1)
    done = 0
    for sub_table, n, size in _transfer_pieces(runner, padded_table, length):
        padded = np.zeros((*shape[:2], size, shape[3]), blocks.dtype)
        padded[:, :, :n] = blocks[:, :, done : done + n]
        runner.kv_graphs().kv_import(sub_table, padded)
        done += n
    runner.kv_graphs().state_import(slot, states)
    runner.slots[slot] = SlotState(length, padded_table, next_token, sampler)


def state_shapes(runner: ModelRunner) -> list[tuple[int, ...]]:
    """The shapes of a transfer's Gated DeltaNet states: conv inputs and recurrent matrices of
    each such layer ([] without them)."""
    shape = runner.spec.linear_attention
    if shape is None:
        return []
    layers = len(shape.layers)
    return [(layers, shape.conv_state), (layers, shape.recurrent_state)]


def largest_kv_transfer_bytes(runner: ModelRunner) -> int:
    """The K/V frame of the longest transfer (a whole sequence), or its states' where larger."""
    row_bytes = runner.cache_row_width() * np.dtype(runner.cache_dtype()).itemsize
    kv = 2 * runner.spec.attention_layers * runner.graphs.inputs.kv_heads * runner.max_len * row_bytes
    return max([kv] + [4 * int(np.prod(shape)) for shape in state_shapes(runner)])


def _check_transfer(runner: ModelRunner, length: int) -> None:
    if not 1 <= length < runner.max_len:
        raise RunnerError(f"a KV transfer holds 1..{runner.max_len - 1} positions, not {length}")
    if runner.runtime.dtype == "bfloat16":
        raise RunnerError("KV transfer of a bfloat16 cache is not supported (NumPy has no bfloat16)")


def _transfer_pieces(
    runner: ModelRunner, table: np.ndarray, length: int
) -> list[tuple[np.ndarray, int, int]]:
    """Positions 0..length-1 of the sequence with `table` as the KV graphs move them: pieces of
    at most the largest prefill bucket, each starting on a block boundary, given as (the table
    from the piece's first block on, its positions, its bucket)."""
    block_size, largest = runner.graphs.inputs.block_size, runner.runtime.prefill_buckets[-1]
    step = largest // block_size * block_size or largest
    if step < length and step % block_size:
        raise RunnerError(
            f"a KV transfer of {length} positions needs the largest prefill bucket ({largest}) "
            f"to hold a whole block ({block_size} positions)"
        )
    pieces = []
    for start in range(0, length, step):
        n = min(step, length - start)
        first = start // block_size  # the table from this block on, scratch blocks after
        sub_table = np.concatenate([table[first:], runner.graphs.inputs.scratch_table[:first]])
        pieces.append((sub_table, n, bucket(runner.runtime.prefill_buckets, n)))
    return pieces
