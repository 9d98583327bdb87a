"""ZeroMQ CURVE on the agents' sockets: encryption plus authentication by public key. Every agent
has its own keypair (agents.curve.agents, in rank order); off loopback the config requires CURVE
(config/agents.py).

    authenticator = secure_agent_socket(router, curve, rank, peers)  # before bind; stop it on close
    authenticator = secure_launcher_socket(router, curve)            # the launcher's control socket
    peer = is_peer(frame, curve)                                     # a peer agent's message?
    secure_client_socket(dealer, ClientKeys(public, secret, agent_public_key))  # before connect

An agent admits the server's public key, and the keys of `peers` (for a decode agent: the prefill
agents, which send it KV), whose messages may only be protocol.PEER_OPS. Clients pin the public key
of the agent they connect to, so a machine holding one agent's secret cannot pose as another.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import zmq
from zmq.auth.thread import ThreadAuthenticator

from config.schema import CurveSection

log = logging.getLogger(__name__)


class _KnownKeys:
    """ZAP credentials check: the server's public key and the peers', nothing else."""

    def __init__(self, allowed: set[str]):
        self.allowed = {key.encode() for key in allowed}

    def callback(self, _domain: str, key: bytes) -> bool:
        if key not in self.allowed:
            log.warning("refused a CURVE client with an unknown public key")
        return key in self.allowed


def secure_agent_socket(
    socket: zmq.Socket, curve: CurveSection, rank: int, peers: list[int]
) -> ThreadAuthenticator:
    public, secret = curve.own_agent_keypair(rank)
    authenticator = ThreadAuthenticator(socket.context, log=logging.getLogger("zmq.auth"))
    authenticator.start()
    allowed = {curve.server_public_key} | {curve.agents[peer].public_key for peer in peers}
    authenticator.configure_curve_callback("*", _KnownKeys(allowed))
    socket.curve_secretkey = secret.encode()
    socket.curve_publickey = public.encode()
    socket.curve_server = True
    return authenticator


def secure_launcher_socket(socket: zmq.Socket, curve: CurveSection) -> ThreadAuthenticator:
    """The launcher's control socket: its own keypair (agents.curve.launcher); only the server's
    key is admitted."""
    assert curve.launcher is not None and curve.launcher.secret_key is not None
    authenticator = ThreadAuthenticator(socket.context, log=logging.getLogger("zmq.auth"))
    authenticator.start()
    authenticator.configure_curve_callback("*", _KnownKeys({curve.server_public_key}))
    socket.curve_secretkey = curve.launcher.secret_key.encode()
    socket.curve_publickey = curve.launcher.public_key.encode()
    socket.curve_server = True
    return authenticator


def is_peer(frame: zmq.Frame, curve: CurveSection) -> bool:
    """Whether a message came from a key other than the server's. ZeroMQ's ZAP handler sets the
    frame's User-Id to the client's Z85 public key (pyzmq's Authenticator.curve_user_id)."""
    return frame.get("User-Id") != curve.server_public_key


@dataclass(frozen=True)
class ClientKeys:
    """A CURVE client's own keypair and the public key of the agent it connects to."""

    public_key: str
    secret_key: str
    agent_public_key: str


def secure_client_socket(socket: zmq.Socket, keys: ClientKeys) -> None:
    socket.curve_serverkey = keys.agent_public_key.encode()
    socket.curve_publickey = keys.public_key.encode()
    socket.curve_secretkey = keys.secret_key.encode()
