"""LauncherClient: the server's end of the launcher's control channel (agent/contract/launcher_control.py),
a zmq.asyncio DEALER per call: a call that gets no answer in time leaves nothing queued behind it."""

from __future__ import annotations

import zmq
import zmq.asyncio

from agent.contract import launcher_control as control
from agent.contract.transport import ClientKeys, secure_client_socket
from config.schema import ServingConfig

CALL_TIMEOUT_S = 30.0  # an unload answers once the agents are gone (agents.shutdown_grace_s, and more)


class LauncherError(Exception):
    """The launcher did not answer, or refused the request (the message says why)."""


class LauncherUnreachable(LauncherError):
    pass


class LauncherClient:
    def __init__(self, config: ServingConfig):
        self.address = f"tcp://127.0.0.1:{config.agents.control_port}"
        self.timeout_s = max(CALL_TIMEOUT_S, 2 * config.agents.shutdown_grace_s + 5)
        curve = config.agents.curve
        self.keys = (
            ClientKeys(*curve.server_keypair(), agent_public_key=curve.launcher.public_key)
            if curve is not None and curve.launcher is not None
            else None
        )
        self.context = zmq.asyncio.Context()

    async def call(self, op: str, **fields) -> dict:
        """The launcher's reply to {op, **fields}; LauncherError when it refuses (ok false)."""
        socket = self.context.socket(zmq.DEALER)
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(zmq.MAXMSGSIZE, control.MAX_MESSAGE_BYTES)
        if self.keys is not None:
            secure_client_socket(socket, self.keys)
        try:
            socket.connect(self.address)
            await socket.send(control.encode({"op": op, **fields}))
            if not await socket.poll(int(self.timeout_s * 1000)):
                raise LauncherUnreachable(
                    f"the agent launcher did not answer on {self.address} within {self.timeout_s:g}s "
                    "(is start_agent.py running with this config?)"
                )
            reply = control.decode(await socket.recv())
        except control.ControlError as exc:
            raise LauncherError(f"the agent launcher's reply is not a control message: {exc}") from exc
        finally:
            socket.close(0)
        if not reply.get("ok"):
            raise LauncherError(str(reply.get("error", "the launcher refused without a reason")))
        return reply

    def close(self) -> None:
        self.context.destroy(linger=0)
