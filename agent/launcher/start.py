"""Launch the agents (one MindSpore process per configured port of each model started), wait for
readiness, supervise; in model_control_mode explicit, load and unload models on the server's request.

python start_agent.py [--config config/default.yaml] [--groups 0,1]    (or: ms-llm-agent ...)
"""

import argparse
import sys

from agent.process_env import set_process_defaults
from config import ConfigError, load_config
from config.logs import setup_logging


def _indexes(text: str) -> list[int]:
    try:
        return [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected group indexes like 0,1, got {text!r}") from None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", help="config file (default: $LLM_SERVING_CONFIG or config/default.yaml)")
    parser.add_argument(
        "--groups",
        type=_indexes,
        help="run only these agent groups (indexes in "
        "agents.groups, e.g. 0,2): each machine of a multi-host set-up runs its own",
    )
    args = parser.parse_args(argv)
    set_process_defaults()  # before MindSpore loads (the launcher imports it) and before agents spawn
    from agent.launcher.model_agents import LaunchError
    from agent.launcher.models import LaunchedModels
    from agent.launcher.preflight import check_config

    try:
        config = load_config(args.config)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    log = setup_logging(config.logging, "agent_launcher.log", console=True)
    problems = check_config(config, args.groups)  # Ascend/GPU: before any agent spawns
    if problems:
        for line in problems:
            log.error("preflight: %s", line)
        return 1
    try:
        models = LaunchedModels(config, args.groups)
        models.install_signal_handlers()
        models.start()
    except LaunchError as exc:
        log.error("%s", exc)
        return 1
    return models.supervise()
