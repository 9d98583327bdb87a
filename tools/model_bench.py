"""Model micro-benchmark: prefill and decode-step latency of the graphs, in this process.

    python -m tools.model_bench [--batches 1 4 8 16 32] [--contexts 128 1024] [--prompts 32 128 512]
    python -m tools.model_bench --warm-up      # time the default config's full warm-up instead
    python -m tools.model_bench --model models/random-1b-Q4_K_M.gguf   # another model, same runtime

Each shape is compiled once, run once more to settle, then timed `--repeats` times (median reported).
Decode at context C: the attention kernel reads C positions; the gather path
(runtime.decode_attention: gather) attends over C rounded up to the next multiple of 256.
Load time and the process's resident memory (after loading, and with the graphs built) are reported
too. Results go to the console and to output/model_bench.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from agent.process_env import set_process_defaults

set_process_defaults()  # before MindSpore loads
import numpy as np  # noqa: E402

from agent.activations import resolve_activations  # noqa: E402
from agent.bootstrap import Placement, build_runner, init_device  # noqa: E402
from agent.graphs.layers import WHOLE_MODEL  # noqa: E402
from agent.memory_plan import MemoryPlanError  # noqa: E402
from agent.model.checkpoint import CheckpointError  # noqa: E402
from agent.model.formats import load_checkpoint  # noqa: E402
from agent.runner import ModelRunner, configure_mindspore  # noqa: E402
from config import PROJECT_ROOT, ConfigError, load_config  # noqa: E402


def resident_mb() -> float:
    """This process's resident memory (VmRSS)."""
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def median_ms(fn, repeats: int) -> float:
    fn()  # settle after the compile run
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return float(np.median(times) * 1000)


def run_grid(runner: ModelRunner, args) -> dict:
    results: dict[str, dict] = {"prefill_ms": {}, "decode_ms": {}}
    vocab = runner.spec.vocab_size
    rng = np.random.default_rng(0)
    inputs = runner.graphs.inputs
    for n in args.prompts:
        tokens = rng.integers(0, vocab, n)
        results["prefill_ms"][n] = ms = median_ms(
            lambda tokens=tokens, n=n: runner.graphs.prefill(inputs.slot_table(0), tokens, n).asnumpy(),
            args.repeats,
        )
        print(f"prefill {n:5d} tokens: {ms:8.1f} ms", flush=True)
    for context in args.contexts:
        attend = -(-(context + 1) // 256) * 256
        for batch in args.batches:
            tables = np.stack([inputs.slot_table(s) for s in range(batch)])
            tokens = rng.integers(0, vocab, batch)
            positions = np.full(batch, context)
            ms = median_ms(
                lambda tables=tables, tokens=tokens, positions=positions, batch=batch, attend=attend: (
                    # each row in its own slot (a Gated DeltaNet layer's state is the slot's)
                    runner.graphs.decode(tables, tokens, positions, batch, attend, slots=list(range(batch)))[
                        1
                    ].asnumpy()
                ),
                args.repeats,
            )
            results["decode_ms"][f"B={batch},context={context}"] = ms
            how = "kernel" if runner.runtime.attention_kernel else f"attend {attend}"
            print(
                f"decode B={batch:3d} context {context:5d} ({how}): {ms:8.1f} ms "
                f"= {batch * 1000 / ms:7.1f} tok/s",
                flush=True,
            )
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", help="config file (default: config/default.yaml)")
    parser.add_argument("--model", help="a model file or directory in place of the config's")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4, 8, 16, 32])
    parser.add_argument("--contexts", type=int, nargs="+", default=[128, 1024])
    parser.add_argument("--prompts", type=int, nargs="+", default=[32, 128, 512])
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument(
        "--warm-up", action="store_true", help="time the configured runner's warm-up (all buckets) instead"
    )
    args = parser.parse_args()
    start = time.perf_counter()
    try:
        config = load_config(args.config)
        if args.model:
            model = config.model.model_copy(update={"path": Path(args.model).resolve()})
            config = config.model_copy(update={"model": model})
        checkpoint = load_checkpoint(config.model.path)
    except (ConfigError, CheckpointError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    load_s = time.perf_counter() - start
    loaded_mb = resident_mb()
    print(f"loaded {checkpoint.spec.name} in {load_s:.1f}s, resident {loaded_mb:.0f} MB", flush=True)
    if args.warm_up:
        try:
            init_device(config, Placement("bench"))
            _, warm_up_s = build_runner(config, Placement("bench"), print, checkpoint)
        except MemoryPlanError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
        results = {"load_s": load_s, "warm_up_s": warm_up_s}
    else:
        # The grid's own shapes: slots for the largest batch, room for the longest context.
        longest = max(max(args.contexts) + 1, max(args.prompts))
        max_len = -(-longest // 256) * 256
        runtime = config.runtime.model_copy(
            update={
                "num_slots": max(args.batches),
                "max_seq_len": max_len,
                "memory_budget_mb": None,  # no budget: a pool of each slot's whole length
                "num_blocks": "auto",
                "prefill_buckets": [max_len],
                "attend_buckets": [max_len],
                "decode_batch_buckets": [max(args.batches)],
                "compile_cache_dir": None,
            }
        )
        # what an agent runs: `activations: auto` decided for these weights on this CPU
        runtime = resolve_activations(checkpoint, runtime, WHOLE_MODEL, print)
        configure_mindspore(runtime)
        runner = ModelRunner.from_checkpoint(checkpoint, runtime)
        built_mb = resident_mb()
        kv_mb = runner.graphs.cache_bytes() / 2**20
        print(f"graphs built, resident {built_mb:.0f} MB (KV cache {kv_mb:.0f} MB)", flush=True)
        results = {"load_s": load_s, "loaded_mb": loaded_mb, "built_mb": built_mb, **run_grid(runner, args)}
    out = PROJECT_ROOT / "output" / "model_bench.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    print(f"results written to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
