"""The scheduler <-> agent wire format. Both sides import this module; nothing else defines it.

A message is a ZeroMQ multipart list: one msgpack header, then one raw frame per array. No pickle.

    header = {"v": PROTOCOL_VERSION, "op": str, "id": int, ...small fields...,
              "arrays": [[dtype, [dim, ...]], ...]}    # describes the frames that follow

Requests (op: fields -> reply fields):
    info:     -                                  -> protocol, model, vocab_size, eos_ids, num_slots,
                                                    max_seq_len, max_prompt_len, prefill_buckets,
                                                    decode_batch_buckets,
                                                    attend_buckets, role, rank, port
    prefill:  slot, sampling {...}, [transfer]; arrays [tokens int32]   -> token,
              with transfer {address, slot, session, ticket}: the prompt's KV goes to that decode
              agent's slot (kv_receive below) and this slot is free again -> also kv_bytes, transfer_ms
    decode:   arrays [slots int32]                         -> arrays [tokens int32]
    release:  slot, [ticket]                               -> - (ticket: a transfer into this slot
                                                              that the scheduler gave up on; it is
                                                              refused if it still arrives)
    kv_receive (agent to agent): slot, ticket, state {length, next_token, sampler};
              arrays [K/V float32|float16 [2 * layers, kv_heads, length, head_dim]]  -> -
    reset:    session                                      -> - (every slot released)
    ping:     -                                            -> -
    shutdown: -                                            -> - (the agent exits after replying)
A reply carries the request's op and id, and "ok": true, or "ok": false with "error" (a message)
and "kind" ("bad_request": the request was wrong; "internal": the agent failed; "transfer_failed":
the prefill ran but its KV did not reach the decode agent; "stale_session": see below).

Sessions: a server opens one with `reset` (a random integer of its choosing) and puts it in every
prefill, decode and release. The agent refuses those ops from any other session, so a request
still queued from a connection the server has given up on (a hung agent resumed, a previous
server) can never touch the slots of the current one.
"""
from __future__ import annotations

from typing import Any, Sequence

import msgpack
import numpy as np

PROTOCOL_VERSION = 3
OPS = ("info", "prefill", "decode", "release", "kv_receive", "reset", "ping", "shutdown")
SESSION_OPS = ("prefill", "decode", "release", "kv_receive")
ALLOWED_DTYPES = {"int32", "int64", "float32", "float16"}
MAX_ARRAY_BYTES = 1 << 30


class ProtocolError(ValueError):
    """A message that does not follow this module's format."""


def encode(header: dict[str, Any], arrays: Sequence[np.ndarray] = ()) -> list:
    """Header + arrays -> frames. Arrays go out as their own buffers (zero-copy in pyzmq)."""
    arrays = [np.ascontiguousarray(a) for a in arrays]
    header = {**header, "v": PROTOCOL_VERSION,
              "arrays": [[a.dtype.name, list(a.shape)] for a in arrays]}
    return [msgpack.packb(header, use_bin_type=True), *(memoryview(a).cast("B") for a in arrays)]


def decode(frames: Sequence[bytes]) -> tuple[dict[str, Any], list[np.ndarray]]:
    """Frames -> (header, arrays); raises ProtocolError naming what is wrong."""
    if not frames:
        raise ProtocolError("empty message")
    try:
        header = msgpack.unpackb(bytes(frames[0]), raw=False)
    except Exception as exc:
        raise ProtocolError(f"header is not msgpack: {exc}") from exc
    if not isinstance(header, dict):
        raise ProtocolError("header must be a msgpack map")
    version = header.get("v")
    if version != PROTOCOL_VERSION:
        raise ProtocolError(f"protocol version mismatch: got {version!r}, "
                            f"this side speaks {PROTOCOL_VERSION}")
    specs = header.get("arrays", [])
    if not isinstance(specs, list) or len(specs) != len(frames) - 1:
        raise ProtocolError(f"header describes {len(specs) if isinstance(specs, list) else '?'} "
                            f"arrays but {len(frames) - 1} array frames follow")
    arrays = []
    for i, (spec, frame) in enumerate(zip(specs, frames[1:])):
        try:
            dtype_name, shape = spec
            shape = tuple(int(d) for d in shape)
        except (TypeError, ValueError) as exc:
            raise ProtocolError(f"array {i}: bad description {spec!r}") from exc
        if dtype_name not in ALLOWED_DTYPES:
            raise ProtocolError(f"array {i}: dtype {dtype_name!r} is not allowed")
        dtype = np.dtype(dtype_name)
        expected = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        if any(d < 0 for d in shape) or expected > MAX_ARRAY_BYTES:
            raise ProtocolError(f"array {i}: bad shape {list(shape)}")
        buffer = memoryview(frame)
        if buffer.nbytes != expected:
            raise ProtocolError(f"array {i}: {buffer.nbytes} bytes do not match "
                                f"{dtype_name}{list(shape)} ({expected} bytes)")
        arrays.append(np.frombuffer(buffer, dtype=dtype).reshape(shape))
    return header, arrays


def ok_reply(request: dict, fields: dict | None = None, arrays: Sequence[np.ndarray] = ()) -> list:
    return encode({"op": request.get("op"), "id": request.get("id"), "ok": True, **(fields or {})},
                  arrays)


def error_reply(request: dict | None, message: str, kind: str = "bad_request") -> list:
    request = request or {}
    return encode({"op": request.get("op"), "id": request.get("id"), "ok": False,
                   "error": message, "kind": kind})
