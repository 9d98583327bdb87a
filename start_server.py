"""Start the LLMServer scheduler and the HTTP front end; the agents must be started already.

    python start_server.py [--config config/default.yaml]
"""
import argparse
import logging
import sys

from agent.model.tokenizer import TokenizerError, load_tokenizer
from config import ConfigError, load_config
from config.logs import setup_logging
from server.app import create_app
from server.http_server import serve
from server.llm_server import LLMServer


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", help="config file (default: $LLM_SERVING_CONFIG or config/default.yaml)")
    args = parser.parse_args()
    try:
        config = load_config(args.config)
        tokenizer = load_tokenizer(config.model.path)
    except (ConfigError, TokenizerError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    setup_logging(config.logging, "server_app.log", console=True, secrets=config.server.api_keys)
    llm_server = LLMServer(config, tokenizer)
    app = create_app(config, tokenizer, llm_server)
    serve(config, app, llm_server)
    return 0


if __name__ == "__main__":
    logging.captureWarnings(True)
    sys.exit(main())
