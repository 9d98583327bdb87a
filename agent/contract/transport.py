"""ZeroMQ CURVE on the agents' sockets: encryption plus authentication of the one client (the
server) whose public key the config names. Off loopback the config requires it (config/schema.py).

    authenticator = secure_agent_socket(router, curve)   # before bind; stop it on close
    secure_client_socket(dealer, curve)                  # before connect
"""

from __future__ import annotations

import logging

import zmq
from zmq.auth.thread import ThreadAuthenticator

from config.schema import CurveSection

log = logging.getLogger(__name__)


class _OnlyTheServer:
    """ZAP credentials check: the server's public key, nothing else."""

    def __init__(self, server_public_key: str):
        self.allowed = server_public_key.encode()

    def callback(self, _domain: str, key: bytes) -> bool:
        if key != self.allowed:
            log.warning("refused a CURVE client with an unknown public key")
        return key == self.allowed


def secure_agent_socket(socket: zmq.Socket, curve: CurveSection) -> ThreadAuthenticator:
    authenticator = ThreadAuthenticator(socket.context, log=logging.getLogger("zmq.auth"))
    authenticator.start()
    authenticator.configure_curve_callback("*", _OnlyTheServer(curve.server_public_key))
    socket.curve_secretkey = curve.agent_secret_key.encode()
    socket.curve_publickey = curve.agent_public_key.encode()
    socket.curve_server = True
    return authenticator


def secure_client_socket(socket: zmq.Socket, curve: CurveSection) -> None:
    socket.curve_serverkey = curve.agent_public_key.encode()
    socket.curve_publickey = curve.server_public_key.encode()
    socket.curve_secretkey = curve.server_secret_key.encode()
