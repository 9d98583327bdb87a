"""Print fresh CURVE keypairs as the `agents.curve` section of a config file.

    python -m tools.curve_keys >> my-config.yaml     # then move the lines under `agents:`

Both the agents and the server read the same section; keep the file private (chmod 600).
"""

import zmq


def main() -> None:
    agent_public, agent_secret = zmq.curve_keypair()
    server_public, server_secret = zmq.curve_keypair()
    print("  curve:")
    for name, key in (
        ("agent_public_key", agent_public),
        ("agent_secret_key", agent_secret),
        ("server_public_key", server_public),
        ("server_secret_key", server_secret),
    ):
        print(f"    {name}: '{key.decode()}'")


if __name__ == "__main__":
    main()
