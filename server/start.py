"""Start the engine and the HTTP front end; the agents must be started already.

python start_server.py [--config config/default.yaml]    (or: ms-llm-server ...)
"""

import argparse
import logging
import sys

from agent.model.tokenizer import TokenizerError, load_tokenizer
from config import ConfigError, load_config
from config.logs import setup_logging
from server.app import create_app
from server.http_server import serve
from server.output import OutputProcessor


def main(argv: list[str] | None = None) -> int:
    logging.captureWarnings(True)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", help="config file (default: $LLM_SERVING_CONFIG or config/default.yaml)")
    args = parser.parse_args(argv)
    try:
        config = load_config(args.config)
        if config.agents.curve is not None:
            config.agents.curve.server_keypair()  # this machine runs the server: its secret is needed
        tokenizer = load_tokenizer(config.model.path)
    except (ConfigError, TokenizerError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    setup_logging(config.logging, "server_app.log", console=True, secrets=config.server.api_keys)
    outputs = OutputProcessor(config, tokenizer)
    app = create_app(config, tokenizer, outputs)
    return serve(config, app, outputs)
