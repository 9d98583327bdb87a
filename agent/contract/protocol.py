"""The scheduler <-> agent wire format. Both sides import this module; nothing else defines it.

A message is a ZeroMQ multipart list: one msgpack header, then one raw frame per array. No pickle.

    header = {"v": PROTOCOL_VERSION, "op": str, "id": int, ...small fields...,
              "arrays": [[dtype, [dim, ...]], ...]}    # describes the frames that follow

Requests (op: fields -> reply fields):
    info:     -                                  -> protocol, model, vocab_size, eos_ids, num_slots,
                                                    max_seq_len, max_prompt_len, num_blocks,
                                                    block_size, max_chunk, chunked_prefill,
                                                    prefix_caching, mixed_rows,
                                                    prefill_buckets, decode_batch_buckets,
                                                    attend_buckets, role, rank, port,
                                                    [kv_tier_keys, kv_tier_write_through,
                                                    kv_tier_capacity (blocks both tiers hold
                                                    at most)]
    step:     chunks [{slot, start, sample, [sampling {...} when sample]}, ...] (StepChunk),
              [drafts [[slot, [token, ...] or count], ...]], [transfer {address, slot, session,
              ticket, table}]; arrays [decode slots int32 [n], their block tables int32 [n, w] (-1
              past a row's blocks), then per chunk its tokens int32 (positions 0..end-1) and block
              table int32]   (agent/contract/step.py StepRequest)
              -> arrays [decode tokens int32], counts [tokens per decode slot], chunk_tokens
              [token or null per chunk], [logprobs, errors: an entry or null per decode token],
              [chunk_logprobs, chunk_errors: per chunk], [chunk_pooled: per chunk whether its
              pooled vector (sampling's pool) follows, float32 arrays after the tokens]
              (agent/contract/step_reply.py StepReply)
              One agent step: a decode of the slots (each slot's pending token written, its next
              one sampled), prompt chunks (positions start..end-1 computed into the table's blocks;
              0..start-1 are there already: an earlier chunk, a prefix-cache hit; sample: the
              prompt's last chunk, whose first token is sampled), or both in one call of at most
              mixed_rows rows (info; 0: this agent runs none; StepLimits); refused whole if any part
              is wrong. drafts (speculative decoding): tokens proposed after a decode slot's pending
              token (at most 16; never for a masked slot; its table covers their positions), or a
              count: that many tokens of the agent's draft model (runtime.speculation method draft;
              fewer, or none, where it cannot follow the slot): its rows are verified, and `counts`
              gives the proposals kept and one more. transfer (a prefill agent, one whole prompt
              alone): its KV goes to that decode agent's slot and blocks (kv_receive below) and
              this slot is free again -> also kv_bytes, transfer_ms
    release:  slot, [ticket]                               -> - (ticket: a transfer into this slot
                                                              that the scheduler gave up on; it is
                                                              refused if it still arrives)
    kv_receive (agent to agent): slot, ticket, state {length, next_token, sampler};
              arrays [K/V float32|float16 [2 * layers, kv_heads, length, head_dim], or a q8_0
                      cache's uint8 rows [..., head_dim / 32 * 34],
                      block table int32]                     -> -
    reset:    session, [epoch]                             -> - (every slot released; epoch: the
                                                              server's start time, refused with
                                                              stale_session below the holder's)
    ping:     -                                            -> -
    drop_cache: session                                    -> tier_blocks (how many the agent's
                                                              KV tier held: all dropped, host
                                                              memory and disk), [tier (a step
                                                              reply's TierReport)]
    shutdown: session                                      -> - (the agent exits after replying)
Token masks (structured output): a step may carry `masked` [slot, ...]
and, after every other array, an int32 array [len(masked), words <= ceil(vocab_size / 32)]: bit j of
word i set means token 32 i + j may be that slot's next token (the server's grammar decides, over
its tokenizer's vocabulary; tokens past the words are not allowed; one choice).
Logprobs: a reply lists them only when a sequence's sampling asked for them (sampling.logprobs);
an entry is [the token's logprob, [[id, logprob], ...] best first] (TokenLogprob.to_wire).
Sequence errors: a choice that fails for one sequence (its grammar allows only what min_tokens
forbids; a logprob that is not finite) is that sequence's error, not the call's: its token is -1
and the reply's `errors` (`chunk_errors` for a step's chunks) lists [kind, message] for it, null for
the others (SequenceFault.to_wire; absent when none failed). Such a slot decodes no more: the server
releases it. A step with transfer sends nothing for it (and frees its slot).
Block tables are the server's: an agent's KV cache is a pool of num_blocks blocks of block_size
positions, and every call names the blocks of each sequence (position p in block table[p // block_size]).
A reply carries the request's op and id, and "ok": true, or "ok": false with "error" (a message)
and "kind" ("bad_request": the request was wrong; "internal": the agent failed; "transfer_failed":
the prefill ran but its KV did not reach the decode agent; "stale_session": see below).

Sessions: a server opens one with `reset` (a random integer of its choosing) and puts it in every
step, release and shutdown (kv_receive carries the decode agent's). The agent refuses
those ops without a session or from any other one, so a request still queued from a connection the
server has given up on (a hung agent resumed, a previous server), or a local process that never
opened one, can never touch the slots of the current server. (`reset` itself opens a new session:
with CURVE off, any local user can still do that; agents.curve admits only the server's key, and
a decode agent the prefill agents' keys for PEER_OPS alone.)
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import msgpack
import numpy as np

# 10: prefill and decode are steps (one op, typed request and reply); 11: chunks may ask for prompt logprobs;
# 12: steps spill and restore blocks of the prefix cache's second tier (an older agent would ignore them);
# 13: drop_cache, and step replies report the tier (TierReport);
# 14: kv_receive may carry a q8_0 cache's uint8 rows;
# 15: a step reply's tier names the keys the agent's tier let go (evicted_keys), info its capacity;
# 16: a step's sampling carries min_p and typical_p (an older agent would ignore them)
PROTOCOL_VERSION = 16
OPS = ("info", "step", "release", "kv_receive", "reset", "ping", "drop_cache", "shutdown")
SESSION_OPS = ("step", "release", "kv_receive", "drop_cache", "shutdown")
PEER_OPS = ("kv_receive",)  # what another agent (not the server) may ask of an agent
ALLOWED_DTYPES = {"int32", "int64", "float32", "float16", "uint8"}
MAX_ARRAY_BYTES = 1 << 30
MAX_ARRAY_DIMS = 8
# The largest frame a peer may send (an array; headers are small): the agents' ZeroMQ MAXMSGSIZE,
# so a larger one is dropped by ZeroMQ before it is ever held in memory.
MAX_FRAME_BYTES = MAX_ARRAY_BYTES


class ProtocolError(ValueError):
    """A message that does not follow this module's format."""


def encode(header: dict[str, Any], arrays: Sequence[np.ndarray] = ()) -> list:
    """Header + arrays -> frames. Arrays go out as their own buffers (zero-copy in pyzmq)."""
    arrays = [np.ascontiguousarray(a) for a in arrays]
    header = {**header, "v": PROTOCOL_VERSION, "arrays": [[a.dtype.name, list(a.shape)] for a in arrays]}
    # (a memoryview of an empty array cannot be cast: its frame is empty bytes)
    return [msgpack.packb(header, use_bin_type=True), *(a.data.cast("B") if a.size else b"" for a in arrays)]


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
        raise ProtocolError(
            f"protocol version mismatch: got {version!r}, this side speaks {PROTOCOL_VERSION}"
        )
    specs = header.get("arrays", [])
    if not isinstance(specs, list) or len(specs) != len(frames) - 1:
        raise ProtocolError(
            f"header describes {len(specs) if isinstance(specs, list) else '?'} "
            f"arrays but {len(frames) - 1} array frames follow"
        )
    arrays = []
    for i, (spec, frame) in enumerate(zip(specs, frames[1:])):
        dtype_name, shape = _array_spec(i, spec)
        dtype = np.dtype(dtype_name)
        expected = math.prod(shape) * dtype.itemsize  # Python ints: no int64 product that wraps
        if expected > MAX_ARRAY_BYTES:
            raise ProtocolError(f"array {i}: {list(shape)} is larger than {MAX_ARRAY_BYTES} bytes")
        buffer = memoryview(frame)
        if buffer.nbytes != expected:
            raise ProtocolError(
                f"array {i}: {buffer.nbytes} bytes do not match {dtype_name}{list(shape)} ({expected} bytes)"
            )
        arrays.append(np.frombuffer(buffer, dtype=dtype).reshape(shape))
    return header, arrays


def _array_spec(i: int, spec: Any) -> tuple[str, tuple[int, ...]]:
    """[dtype name, [dim, ...]] from a peer: checked for type, not just converted (int(inf) raises
    OverflowError, a list as dtype name is unhashable)."""
    if not (
        isinstance(spec, (list, tuple))
        and len(spec) == 2
        and isinstance(spec[0], str)
        and isinstance(spec[1], (list, tuple))
        and len(spec[1]) <= MAX_ARRAY_DIMS
    ):
        raise ProtocolError(f"array {i}: bad description {str(spec)[:200]} (want [dtype, [dims]])")
    dtype_name, shape = spec
    if dtype_name not in ALLOWED_DTYPES:
        raise ProtocolError(f"array {i}: dtype {dtype_name[:50]!r} is not allowed")
    if not all(type(d) is int and 0 <= d <= MAX_ARRAY_BYTES for d in shape):
        raise ProtocolError(f"array {i}: bad shape {str(shape)[:200]}")
    return dtype_name, tuple(shape)


def ok_reply(request: dict, fields: dict | None = None, arrays: Sequence[np.ndarray] = ()) -> list:
    return encode({"op": request.get("op"), "id": request.get("id"), "ok": True, **(fields or {})}, arrays)


def error_reply(request: dict | None, message: str, kind: str = "bad_request") -> list:
    request = request or {}
    return encode(
        {"op": request.get("op"), "id": request.get("id"), "ok": False, "error": message, "kind": kind}
    )
