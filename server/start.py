"""Start the engine and the HTTP front end; the agents must be started already.

python start_server.py [--config config/default.yaml]    (or: ms-llm-server ...)
"""

import argparse
import logging
import sys

from agent.model.tokenizer import TokenizerError, load_tokenizer
from config import ConfigError, load_config
from config.logs import setup_logging
from server.access import check_model_control
from server.app import create_app
from server.http_server import serve
from server.model_repository import ModelRepository


def main(argv: list[str] | None = None) -> int:
    logging.captureWarnings(True)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", help="config file (default: $LLM_SERVING_CONFIG or config/default.yaml)")
    args = parser.parse_args(argv)
    try:
        config = load_config(args.config)
        check_model_control(config)
        models = config.model_configs()
        for model in models.values():
            if model.agents.curve is not None:
                model.agents.curve.server_keypair()  # this machine runs the server: its secret is needed
        # The startup models' tokenizers; the others' are read when they are loaded.
        tokenizers = {name: load_tokenizer(models[name].model.path) for name in config.startup()}
    except (ConfigError, TokenizerError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    s = config.server
    setup_logging(config.logging, "server_app.log", console=True, secrets=[*s.api_keys, *s.admin_api_keys])
    try:
        repository = ModelRepository(config, tokenizers)
    except ValueError as exc:  # tracing asked for without OpenTelemetry installed
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return serve(config, create_app(config, repository), repository)
