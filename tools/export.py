"""Export the model's graphs as MindIR files: prefill and decode per bucket, argmax, top-k per k,
with manifest.json and the tokenizer files, for agents that run graphs from files (and for
MindSpore's own deployment tools).

    python -m tools.export [--config config/default.yaml] [--output output/mindir]

The runtime section fixes the shapes (num_slots/max_seq_len/num_blocks "auto" are planned first): an agent
runs the files only with the same num_slots, max_seq_len, num_blocks and buckets. The command prints the
model-section lines that select the files.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from agent.process_env import set_process_defaults
from agent.warm_up import warm_up

set_process_defaults()  # before MindSpore loads
from agent.activations import exact  # noqa: E402
from agent.bootstrap import Placement, init_device, prepare_checkpoint  # noqa: E402
from agent.graphs.mindir import GraphExporter  # noqa: E402
from agent.known_answer import KnownAnswer  # noqa: E402
from agent.memory_plan import MemoryPlanError  # noqa: E402
from agent.model.checkpoint import CheckpointError  # noqa: E402
from agent.model.tokenizer import TokenizerError, load_tokenizer  # noqa: E402
from agent.runner import ModelRunner  # noqa: E402
from config import ConfigError, load_config  # noqa: E402
from config.schema import resolve_path  # noqa: E402


def export(config, output: Path, progress=print) -> dict[str, list[dict]]:
    """Write every graph of `config` into `output`; returns the manifest's file lists."""
    if config.runtime.kv_cache_dtype == "q8_0":  # served MindIR graphs keep float caches (config.serving)
        raise ConfigError("runtime.kv_cache_dtype q8_0 is not exported: export with kv_cache_dtype auto")
    tokenizer = load_tokenizer(config.model.path)
    if config.runtime.activations == "auto":  # served MindIR graphs have no int8 choice (config.serving)
        config = exact(config)
    # no compile cache: the export traces every graph afresh
    init_device(config, Placement(cache_user=None))
    checkpoint, runtime, _, _ = prepare_checkpoint(config, Placement(cache_user=None), progress)
    if checkpoint.spec.linear_attention is not None:  # the exported graphs take no state slots
        raise ConfigError(
            f"{checkpoint.spec.architecture}: models with Gated DeltaNet layers are not exported to MindIR; "
            "serve them from their file"
        )
    if checkpoint.spec.bidirectional:  # exported graphs return logits only; an encoder's are zeros
        raise ConfigError(
            f"{checkpoint.spec.architecture}: encoders are not exported to MindIR (its graphs keep no "
            "hidden states, the only output an encoder has); serve it from its file"
        )
    output.mkdir(parents=True, exist_ok=True)
    exporter = GraphExporter(checkpoint, runtime, output)
    warm_up(ModelRunner(exporter, runtime), progress)  # the warm-up calls every graph shape once
    exporter.write_manifest(runtime, KnownAnswer.of_checkpoint(checkpoint, runtime))
    tokenizer.save(output)
    return exporter.files


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", help="config file (default: config/default.yaml)")
    parser.add_argument(
        "--output",
        type=Path,
        default=Path("output/mindir"),
        help="directory to write (relative paths: to the project root)",
    )
    args = parser.parse_args()
    output = resolve_path(args.output)
    start = time.perf_counter()
    try:
        files = export(load_config(args.config), output)
    except (ConfigError, CheckpointError, TokenizerError, MemoryPlanError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    size = sum(p.stat().st_size for p in output.rglob("*") if p.is_file())
    print(
        f"exported to {output} ({size / 1e6:.1f} MB) in {time.perf_counter() - start:.1f}s; "
        f"serve them with this model section:\n"
    )
    print(f"model:\n  path: {output}  # tokenizer files")
    for kind, graphs in files.items():
        names = [str(output / g["file"]) for g in graphs]
        print(f"  {kind}: {names[0]}" if kind == "argmax_model" else f"  {kind}: [{', '.join(names)}]")
    return 0


if __name__ == "__main__":
    sys.exit(main())
