"""The static check of a configuration's Ascend graphs, on CPU (agent/graphs/op_check.py): builds
the graphs its runtime selects (device_target, dtype, attention, matmul; small shapes) over a model of
Llama-2-7B's architecture with random weights (or --model), traces each to MindIR without compiling
a kernel, and prints every graph's operators and those MindSpore does not run on Ascend (exit 1
where there is one, or a Custom op).

    python -m tools.ascend_ops [--config config/llama2_7b_ascend.yaml] [--model PATH] [--compile]

--compile also compiles each graph for Ascend (kernel selection and build): that needs MindSpore's
Ascend plugin, which loads only with the CANN toolkit; without an NPU, under MindSpore's dry run:
`MS_SIMULATION_LEVEL=0 python -m tools.ascend_ops --compile` (README "On Ascend"). Without CANN it
stops with MindSpore's reason.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from agent.process_env import set_process_defaults

set_process_defaults()  # before MindSpore loads
import mindspore as ms  # noqa: E402
from gguf import GGMLQuantizationType  # noqa: E402

from agent.graphs.op_check import GRAPH_NODES, not_on_ascend, small_shapes, step_graph_ops  # noqa: E402
from agent.graphs.step_graphs import StepGraphs  # noqa: E402
from agent.model.formats import load_checkpoint  # noqa: E402
from agent.runner import configure_mindspore  # noqa: E402
from config import ConfigError, load_config  # noqa: E402
from config.schema import RuntimeSection  # noqa: E402
from tools.make_gguf import Shape, write_random_gguf  # noqa: E402

# Llama-2-7B's architecture (multi-head attention, untied LM head) at a size that builds in seconds
LLAMA2_SHAPE = Shape(hidden=128, layers=2, ffn=256, heads=4, kv_heads=4, tied=False)


def graph_ops(runtime: RuntimeSection, model: Path, compile_graphs: bool = False) -> dict[str, set[str]]:
    """Each step graph's operators as `runtime` builds them for `model`: traced on CPU, or also
    compiled on Ascend (compile_graphs; RuntimeError where MindSpore cannot use Ascend)."""
    if compile_graphs:  # no preflight: a dry run has no device to count
        ms.set_context(mode=ms.GRAPH_MODE, jit_config={"jit_level": "O0"})
        ms.set_device("Ascend")
    else:
        configure_mindspore(RuntimeSection(compile_cache_dir=None))  # CPU: no kernel is compiled
    shapes = small_shapes(runtime)
    return step_graph_ops(StepGraphs(load_checkpoint(model), shapes), shapes, compile_graphs)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="config/llama2_7b_ascend.yaml", help="config file")
    parser.add_argument(
        "--model", type=Path, help="a model to build (default: random, Llama-2's architecture)"
    )
    parser.add_argument("--compile", action="store_true", help="also compile each graph for Ascend (CANN)")
    args = parser.parse_args()
    try:
        runtime = load_config(args.config).runtime
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    with tempfile.TemporaryDirectory() as scratch:
        model = args.model or write_random_gguf(
            Path(scratch) / "llama2-shape.gguf", LLAMA2_SHAPE, lambda name, layers: GGMLQuantizationType.F16
        )
        try:
            graphs = graph_ops(runtime, model, args.compile)
        except RuntimeError as exc:
            reason = str(exc).splitlines()[0]
            print(f"error: {reason} (--compile needs the CANN toolkit: README, On Ascend)", file=sys.stderr)
            return 1
    print(
        f"{args.config}: device_target {runtime.device_target}, dtype {runtime.dtype}, "
        f"decode_attention {runtime.decode_attention}, matmul {runtime.matmul}"
    )
    for name, ops in graphs.items():
        print(f"{name}: {' '.join(sorted(ops - GRAPH_NODES))}")
    everything = set().union(*graphs.values())
    refused = not_on_ascend(everything)
    print(f"all: {' '.join(sorted(everything - GRAPH_NODES))}")
    print(f"not on Ascend: {' '.join(refused) if refused else 'none'}")
    return 1 if refused else 0


if __name__ == "__main__":
    sys.exit(main())
