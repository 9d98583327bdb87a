"""The static check of a configuration's Ascend graphs, on CPU: builds the graphs its runtime selects
(device_target, dtype, attention, matmul; small buckets) over a model with the configuration's
attention as one rank runs it (heads, KV heads, head_dim 128: the shapes the attention kernels
see; hidden, FFN, vocabulary and layers cut so that it builds in seconds) and random weights (or
--model), traces each to MindIR without compiling a kernel, and prints

- the graph contract (agent/graphs/graph_contract.py): the context the agent sets, each graph's
  predict phase, each input's name, dtype and shape and the kernel operands it feeds;
- every graph's operators, and those MindSpore does not run on Ascend.

Exit 1 on any difference from the upstream contract, or an operator not on Ascend.

    python -m tools.ascend_ops [--config config/qwen3_8b_ascend.yaml] [--model PATH] [--compile]

--compile also compiles each graph for Ascend with the agent's context (kernel selection and
build): that needs MindSpore's Ascend plugin, which loads only with the CANN toolkit; without an
NPU, under MindSpore's dry run: `MS_SIMULATION_LEVEL=0 python -m tools.ascend_ops --compile`
(README "On Ascend"). Without CANN it stops with MindSpore's reason.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import tempfile
from pathlib import Path

from agent.process_env import set_process_defaults

set_process_defaults()  # before MindSpore loads
import mindspore as ms  # noqa: E402
from gguf import GGMLQuantizationType  # noqa: E402

from agent.graphs.graph_contract import check_contract  # noqa: E402
from agent.graphs.op_check import GRAPH_NODES, not_on_ascend, small_shapes, step_graph_ops  # noqa: E402
from agent.graphs.step_graphs import StepGraphs  # noqa: E402
from agent.model.formats import load_checkpoint  # noqa: E402
from agent.runner import configure_mindspore  # noqa: E402
from config import ConfigError, load_config  # noqa: E402
from config.schema import RuntimeSection, ServingConfig  # noqa: E402
from tools.make_gguf import SHAPES, Shape, write_random_gguf  # noqa: E402

# The architecture of each shipped Ascend configuration's model (tools.make_gguf presets)
CONFIG_SHAPES = {
    "llama-2-7b-chat": "7b",
    "qwen3-8b": "qwen3-8b",
    "qwen3-32b": "qwen3-32b",
    "qwen3-30b-a3b": "qwen3-30b-a3b",
}


def rank_shape(shape: Shape, ranks: int) -> Shape:
    """`shape`'s attention as one rank of a tensor-parallel group of `ranks` runs it (its share of
    the query and KV heads, head_dim unchanged), with hidden, FFN, experts and layers cut: the
    attention kernels' operands keep their real shapes, the graphs build in seconds."""
    return dataclasses.replace(
        shape,
        hidden=256,
        layers=2,
        ffn=256,
        heads=shape.heads // ranks,
        kv_heads=max(1, shape.kv_heads // ranks),
        head_dim=shape.hd,
        experts=min(shape.experts, 4),
        experts_used=min(shape.experts_used, 2),
        expert_ffn=min(shape.expert_ffn, 64),
    )


def configure(runtime: RuntimeSection, compile_graphs: bool) -> None:
    """The agent's MindSpore context: on Ascend to compile (no preflight: a dry run has no device to
    count), or on CPU to trace only."""
    if compile_graphs:
        ms.set_context(mode=ms.GRAPH_MODE, jit_config=runtime.jit_config)
        ms.set_device("Ascend")
    else:
        configure_mindspore(RuntimeSection(compile_cache_dir=None))  # CPU: no kernel is compiled


def model_for(config: ServingConfig, given: Path | None, scratch: Path) -> tuple[Path, str]:
    """The model to build the graphs over, and what it is."""
    if given is not None:
        return given, str(given)
    ranks = max(len(group.ports) for group in config.agents.groups)
    preset = CONFIG_SHAPES.get(config.model.name, "7b")
    shape = rank_shape(SHAPES[preset], ranks)
    path = write_random_gguf(scratch / "shape.gguf", shape, lambda name, layers: GGMLQuantizationType.F16)
    share = f", one rank of {ranks}" if ranks > 1 else ""
    return path, (
        f"random weights, {preset}'s attention{share} ({shape.heads} heads, {shape.kv_heads} KV heads, "
        f"head_dim {shape.hd}; hidden {shape.hidden}, {shape.layers} layers)"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="config/qwen3_8b_ascend.yaml", help="config file")
    parser.add_argument(
        "--model", type=Path, help="a model to build (default: random, the config's architecture)"
    )
    parser.add_argument("--compile", action="store_true", help="also compile each graph for Ascend (CANN)")
    args = parser.parse_args()
    try:
        config = load_config(args.config)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    runtime = config.runtime
    with tempfile.TemporaryDirectory() as scratch:
        model, described = model_for(config, args.model, Path(scratch))
        try:
            configure(runtime, args.compile)
            shapes = small_shapes(runtime)
            graphs = StepGraphs(load_checkpoint(model), shapes)
            ops = step_graph_ops(graphs, shapes, args.compile)
        except RuntimeError as exc:
            reason = str(exc).splitlines()[0]
            print(f"error: {reason} (--compile needs the CANN toolkit: README, On Ascend)", file=sys.stderr)
            return 1
    print(
        f"{args.config}: device_target {runtime.device_target}, dtype {runtime.dtype}, "
        f"decode_attention {runtime.decode_attention}, matmul {runtime.matmul}; model: {described}"
    )
    problems = 0
    if runtime.paged_attention:
        report = check_contract(graphs, shapes)
        print("\n".join(report.lines()))
        problems = len(report.problems)
    for name, found in ops.items():
        print(f"{name}: {' '.join(sorted(found - GRAPH_NODES))}")
    everything = set().union(*ops.values())
    refused = not_on_ascend(everything)
    print(f"all: {' '.join(sorted(everything - GRAPH_NODES))}")
    print(f"not on Ascend: {' '.join(refused) if refused else 'none'}")
    print(f"contract: {'passed' if not problems else f'{problems} problems'}")
    return 1 if refused or problems else 0


if __name__ == "__main__":
    sys.exit(main())
