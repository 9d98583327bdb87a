"""Start the LLMServer scheduler and the HTTP front end; the agents must be started already.

    python start_server.py [--config config/default.yaml]
"""
import argparse
import logging
import signal
import sys

import uvicorn

from agent.checkpoint import CheckpointError
from config import ConfigError, load_config
from config.logs import setup_logging
from server.app import create_app
from server.llm_server import LLMServer
from server.tokenizer import load_tokenizer


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", help="config file (default: $LLM_SERVING_CONFIG or config/default.yaml)")
    args = parser.parse_args()
    try:
        config = load_config(args.config)
        tokenizer = load_tokenizer(config.model.path)
    except (ConfigError, CheckpointError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    log = setup_logging(config.logging, "server_app.log", console=True)
    log.info("serving %s on http://%s:%d", config.model.name, config.server.host, config.server.port)
    app = create_app(config, tokenizer, LLMServer(config, tokenizer))

    # uvicorn drains on SIGTERM/SIGINT, then re-raises the signal under the handler it found:
    # a handler that only logs makes that a clean exit 0.
    def stopped(signum, _frame):
        log.info("stopped by signal %d", signum)

    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, stopped)
    uvicorn.run(app, host=config.server.host, port=config.server.port, log_config=None,
                timeout_graceful_shutdown=config.server.drain_timeout_s)
    return 0


if __name__ == "__main__":
    logging.captureWarnings(True)
    sys.exit(main())
