"""Print fresh CURVE keypairs as the `agents.curve` section of a config file: the server's and one
per agent port (rank order: agents.ports, or the groups' ports in order).

    python -m tools.curve_keys --agents 2 >> my-config.yaml   # then move the lines under `agents:`
    python -m tools.curve_keys --agents 2 --launcher          # with the launcher's control channel
                                                              # keypair (model_control_mode explicit)

A machine needs only its own secrets: the server's machine the server_secret_key, each agent's
machine that agent's secret_key; delete the others from its copy and keep the file private
(chmod 600). The public keys are needed everywhere.
"""

import argparse

import zmq


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--agents", type=int, default=1, help="how many agent ports the config has (default 1)"
    )
    parser.add_argument(
        "--launcher",
        action="store_true",
        help="also a keypair for the launcher's control channel (model_control_mode explicit)",
    )
    args = parser.parse_args()
    if not 1 <= args.agents <= 1024:
        parser.error("--agents must be between 1 and 1024")
    server_public, server_secret = zmq.curve_keypair()
    print("  curve:")
    print(f"    server_public_key: '{server_public.decode()}'")
    print(f"    server_secret_key: '{server_secret.decode()}'")
    print("    agents:  # one per agent port, in rank order")
    for _ in range(args.agents):
        public, secret = zmq.curve_keypair()
        print(f"      - {{public_key: '{public.decode()}', secret_key: '{secret.decode()}'}}")
    if args.launcher:
        public, secret = zmq.curve_keypair()
        print(f"    launcher: {{public_key: '{public.decode()}', secret_key: '{secret.decode()}'}}")


if __name__ == "__main__":
    main()
