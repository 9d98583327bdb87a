"""The launcher's control channel (model_control_mode explicit): the server asks the agent launcher,
the one process that owns agent processes, to load and unload models. Both sides import this module.

A DEALER (the server) talks to the launcher's ROUTER on 127.0.0.1:agents.control_port; each message
is one msgpack map, each way, of at most MAX_MESSAGE_BYTES (ZeroMQ drops a larger one before the
launcher reads it). With agents.curve.launcher keys the channel is CURVE: the launcher admits only
the server's key, as an agent does.

    {"op": "status"[, "model": name]} -> {"ok": true, "models": {name: {"state", "reason", "pids",
                                                                        "memory_mb"}}} (of every
                                         model, or of the one named)
    {"op": "load", "model": name}   -> {"ok": true, "state": "LOADING" | "READY"}
                                       or {"ok": false, "error": why (memory: the sizes)}
    {"op": "unload", "model": name} -> {"ok": true, "state": "UNAVAILABLE"} once its agents are gone

A load answers at once; its agents start in the background (follow them with status: READY, or
UNAVAILABLE with the failing agent's error and last log lines). Loads and unloads are idempotent.
"""

from __future__ import annotations

import msgpack

MAX_MESSAGE_BYTES = 64 * 1024
MAX_REASON_CHARS = 8000  # a reason's tail (the log lines): several models' fit in one status reply
OPS = ("status", "load", "unload")
# Triton's model states.
READY, LOADING, UNLOADING, UNAVAILABLE = "READY", "LOADING", "UNLOADING", "UNAVAILABLE"


class ControlError(Exception):
    """A control message that is not one (its sender gets this as the error)."""


def encode(message: dict) -> bytes:
    return msgpack.packb(message, use_bin_type=True)


def decode(frame: bytes) -> dict:
    try:
        message = msgpack.unpackb(frame, raw=False)
    except Exception as exc:  # msgpack raises several kinds on bad bytes
        raise ControlError(f"not a msgpack message: {type(exc).__name__}") from exc
    if not isinstance(message, dict):
        raise ControlError("a control message is a map")
    return message


def clip(reason: str) -> str:
    """A reason short enough for a reply: its end, where the last log lines are."""
    return reason if len(reason) <= MAX_REASON_CHARS else "..." + reason[-MAX_REASON_CHARS:]
