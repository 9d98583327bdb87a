"""The launcher's end of the control channel (agent/contract/launcher_control.py): a ROUTER on
127.0.0.1:agents.control_port whose requests are answered by a handler, between supervision passes."""

from __future__ import annotations

import logging
from collections.abc import Callable

import zmq

from agent.contract import launcher_control as control
from config.schema import ServingConfig

log = logging.getLogger("agent_launcher")


class ControlChannel:
    def __init__(self, config: ServingConfig):
        """Binds at once: a port that is taken fails the launcher's start (zmq.ZMQError)."""
        self.context = zmq.Context()
        self.socket = self.context.socket(zmq.ROUTER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.MAXMSGSIZE, control.MAX_MESSAGE_BYTES)
        self.authenticator = None
        curve = config.agents.curve
        if curve is not None and curve.launcher is not None:
            from agent.contract.transport import secure_launcher_socket

            if curve.launcher.secret_key is None:
                raise ValueError("agents.curve.launcher has no secret_key: this machine runs the launcher")
            self.authenticator = secure_launcher_socket(self.socket, curve)
        self.address = f"tcp://127.0.0.1:{config.agents.control_port}"
        try:
            self.socket.bind(self.address)
        except zmq.ZMQError:
            self.close()
            raise
        log.info("control channel on %s%s", self.address, " (CURVE)" if self.authenticator else "")

    def answer(self, handle: Callable[[dict], dict], timeout_s: float) -> None:
        """Answer every request that arrives within `timeout_s` (waits that long when none does)."""
        if not self.socket.poll(int(timeout_s * 1000)):
            return
        while True:
            try:
                frames = self.socket.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(frames) != 2:
                continue  # not a DEALER's one-frame message: nothing to answer
            try:
                reply = handle(control.decode(frames[1]))
            except control.ControlError as exc:
                reply = {"ok": False, "error": str(exc)}
            except Exception as exc:  # that request's failure: the channel answers the next one
                log.exception("a control request failed")
                reply = {"ok": False, "error": f"the launcher failed: {type(exc).__name__}: {exc}"}
            self.socket.send_multipart([frames[0], control.encode(reply)])

    def close(self) -> None:
        if self.authenticator is not None:
            self.authenticator.stop()
        self.socket.close(0)
        self.context.term()
