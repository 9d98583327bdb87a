"""Convert a checkpoint (GGUF, HuggingFace directory, or .ckpt) into a MindSpore checkpoint
directory: model.ckpt (canonical tensor names + the model spec) and the tokenizer files.

    python -m tools.convert models/SmolLM2-135M-Instruct.Q4_1.gguf models/smollm2-ckpt [--dtype float16]

Serve the result by pointing model.path at the output directory.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from tqdm import tqdm

from agent.model.checkpoint import CheckpointError
from agent.model.formats import load_checkpoint, ms_ckpt
from agent.model.tokenizer import TokenizerError, load_tokenizer
from agent.process_env import set_process_defaults


def convert(source: Path, output: Path, dtype: ms_ckpt.StorageDtype = "float32") -> Path:
    """Write `output`/model.ckpt and the tokenizer files; returns the checkpoint path."""
    checkpoint = load_checkpoint(source, progress=lambda items: tqdm(items, desc="read", unit="tensor"))
    tokenizer = load_tokenizer(source)
    tokenizer.check_fits(checkpoint.spec.vocab_size)
    output.mkdir(parents=True, exist_ok=True)
    target = output / ms_ckpt.FILE_NAME
    ms_ckpt.save(
        checkpoint, target, progress=lambda items: tqdm(items, desc="write", unit="tensor"), dtype=dtype
    )
    tokenizer.save(output)
    return target


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("source", type=Path, help=".gguf file, HuggingFace directory or .ckpt")
    parser.add_argument("output", type=Path, help="directory to write (created if missing)")
    parser.add_argument(
        "--dtype",
        choices=["float32", "float16", "bfloat16"],
        default="float32",
        help="storage type of the weights (the CPU runtime computes in float32)",
    )
    args = parser.parse_args()
    set_process_defaults()  # before MindSpore loads (ms_ckpt imports it when it writes)
    start = time.perf_counter()
    try:
        target = convert(args.source, args.output, args.dtype)
    except (CheckpointError, TokenizerError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(
        f"wrote {target} ({target.stat().st_size / 1e6:.1f} MB) and the tokenizer files in "
        f"{time.perf_counter() - start:.1f}s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
