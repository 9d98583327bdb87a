"""The memory plan of a model on one device card, from the model's spec alone (no weights are read):
weights, KV cache, working memory, each reserve, and the card's headroom (agent/memory_plan.py).

    python -m tools.memory_plan --config config/llama2_7b_ascend.yaml --card-mb 32768 \\
        [--model DIR | FILE.gguf] [--dtype bfloat16] [--tensor-parallel 2] [--budget-mb 25000]

--model: a HuggingFace directory, of which config.json alone is read (the weights need not be
there), or a GGUF file (its header); default: the config's model.path. The budget: --budget-mb,
else the card less what the config leaves outside its budget (agents.device_memory_mb less
runtime.memory_budget_mb: CANN's runtime and the driver's own), so one config sizes any card.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from agent.memory_plan import MB, MemoryPlan, MemoryPlanError, plan_memory, rank_spec, weights_bytes
from agent.model.checkpoint import CheckpointError
from agent.model.formats import gguf_file, hf_dir
from agent.model.spec import ModelSpec
from config import ConfigError, load_config
from config.schema import RuntimeSection, ServingConfig, resolve_path


def model_spec(path: Path) -> tuple[ModelSpec, int | None]:
    """The model's spec, and a GGUF's weights as its header sizes them (None: from the spec)."""
    if path.is_file() and path.suffix == ".gguf":
        return gguf_file.stored_weights(path)
    if (path / "config.json").is_file():
        return hf_dir.read_spec(path), None
    problem = "does not exist" if not path.exists() else "is no directory with config.json nor .gguf file"
    raise CheckpointError(
        f"model {path} {problem}: give --model a HuggingFace directory with config.json (the weights "
        "need not be there) or a .gguf file"
    )


def card_budget(config: ServingConfig, card_mb: int) -> int:
    """The budget of a card of `card_mb`: the card less what the config leaves outside its budget."""
    device_mb, budget_mb = config.agents.device_memory_mb, config.runtime.memory_budget_mb
    if device_mb is None or budget_mb is None:
        raise ConfigError(
            "the config sets no agents.device_memory_mb and runtime.memory_budget_mb to size a card's "
            "budget from: give --budget-mb"
        )
    return card_mb - (device_mb - budget_mb)


def describe_card(
    name: str, runtime: RuntimeSection, card_mb: int, plan: MemoryPlan, ranks: int
) -> list[str]:
    """The plan's lines under a heading, then the card's headroom."""
    budget = runtime.memory_budget_mb or 0
    share = f", one rank of {ranks}" if ranks > 1 else ""
    return [
        f"{name} ({runtime.dtype}{share}) on a {card_mb} MB {runtime.device_target} card, "
        f"memory_budget_mb {budget}:",
        plan.describe(),
        f"headroom: {card_mb - plan.total_mb:.0f} MB of the card outside the plan ({card_mb - budget} MB "
        f"outside the budget, {budget - plan.total_mb:.0f} MB of the budget unplanned)",
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", help="config file (default: config/default.yaml)")
    parser.add_argument("--card-mb", type=int, required=True, help="the device card's memory, MB")
    parser.add_argument("--model", type=Path, help="HF directory (config.json) or .gguf; default: model.path")
    parser.add_argument("--dtype", choices=["float32", "float16", "bfloat16"], help="default: runtime.dtype")
    parser.add_argument(
        "--tensor-parallel", type=int, help="ranks of the group (default: the config's largest group's)"
    )
    parser.add_argument("--budget-mb", type=int, help="memory_budget_mb (default: from the card)")
    args = parser.parse_args(argv)
    try:
        config = load_config(args.config)
        path = resolve_path(args.model) if args.model else Path(config.model.path)
        spec, stored = model_spec(path)
        budget = args.budget_mb if args.budget_mb is not None else card_budget(config, args.card_mb)
        if budget < 1:
            raise ConfigError(f"a {args.card_mb} MB card leaves no budget ({budget} MB)")
        update = {"memory_budget_mb": budget} | ({"dtype": args.dtype} if args.dtype else {})
        runtime = RuntimeSection.model_validate({**config.runtime.model_dump(exclude_unset=True), **update})
        ranks = args.tensor_parallel or max(group.tensor_parallel for group in config.agents.groups)
        share = rank_spec(spec, ranks)
        weights = stored if stored is not None and ranks == 1 else None
        held = (weights_bytes(share, runtime) if weights is None else weights) / MB
        if held >= budget:
            raise MemoryPlanError(
                f"{spec.name} does not fit a {args.card_mb} MB card: its weights in {runtime.dtype} "
                f"take {held:.0f} MB{' a rank' if ranks > 1 else ''}, the card's budget is {budget} MB; "
                "use a larger card, more ranks (--tensor-parallel) or a smaller dtype"
            )
        _, plan = plan_memory(share, runtime, weights, ranks)
    except (ConfigError, CheckpointError, MemoryPlanError, ValueError) as exc:
        print(f"refused: {exc}", file=sys.stderr)
        return 1
    print("\n".join(describe_card(spec.name, runtime, args.card_mb, plan, ranks)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
