"""One-shot generation in this process, no server: load the model, answer a prompt, print it.

python -m tools.generate "What is the capital of France?" [--max-new-tokens 64] [--raw]
"""

from __future__ import annotations

import argparse
import sys
import time

from agent.process_env import set_process_defaults

set_process_defaults()  # before MindSpore loads
from agent.bootstrap import Placement, build_runner, init_device  # noqa: E402
from agent.contract.sampling import SamplingParams, add_sampling_options, sampling_options  # noqa: E402
from agent.contract.step import StepChunk, StepRequest  # noqa: E402
from agent.known_answer import KnownAnswerError  # noqa: E402
from agent.memory_plan import MemoryPlanError  # noqa: E402
from agent.model.checkpoint import CheckpointError  # noqa: E402
from agent.model.detokenizer import IncrementalDetokenizer  # noqa: E402
from agent.model.formats import load_checkpoint  # noqa: E402
from agent.model.tokenizer import TokenizerError, load_tokenizer  # noqa: E402
from config import ConfigError, load_config  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("prompt")
    parser.add_argument("--config", help="config file (default: config/default.yaml)")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--raw", action="store_true", help="send the prompt as is, no chat template")
    add_sampling_options(parser, top_k=0)
    args = parser.parse_args()
    try:  # every graph compiled (or read from the cache) and checked against the weights
        config = load_config(args.config)
        init_device(config, Placement("generate"))
        checkpoint = load_checkpoint(config.model.path)
        tokenizer = load_tokenizer(config.model.path)
        tokenizer.check_fits(checkpoint.spec.vocab_size)
        runner, _ = build_runner(
            config, Placement("generate"), lambda line: print(line, file=sys.stderr), checkpoint
        )
    except (ConfigError, CheckpointError, TokenizerError, MemoryPlanError, KnownAnswerError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    sampling = SamplingParams(**sampling_options(args))
    messages = [{"role": "user", "content": args.prompt}]
    prompt = tokenizer.encode(args.prompt) if args.raw else tokenizer.encode_chat(messages)
    stop_ids = set(tokenizer.eos_ids) | set(checkpoint.spec.eos_ids)
    detok = IncrementalDetokenizer(tokenizer)
    start = time.perf_counter()
    table = runner.graphs.inputs.slot_table(0)
    sampled = runner.execute(StepRequest(chunks=[StepChunk(0, prompt, table, 0, sampling)])).firsts[0]
    first = time.perf_counter() - start
    generated = 0
    while (
        sampled is not None
        and sampled.fault is None
        and sampled.token not in stop_ids
        and generated < args.max_new_tokens
    ):
        print(detok.add(sampled.token), end="", flush=True)
        generated += 1
        if generated == args.max_new_tokens or runner.active(0).length >= runner.max_len:
            break
        sampled = runner.execute(StepRequest(slots=[0], tables=[table])).decoded[0][0]
    print(detok.flush())
    if sampled is not None and sampled.fault is not None:
        print(f"error: {sampled.fault.message}", file=sys.stderr)
    total = time.perf_counter() - start
    print(
        f"[{len(prompt)} prompt tokens, {generated} generated, first token {first:.2f}s, total {total:.2f}s]",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
