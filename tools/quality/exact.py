"""python -m tools.quality.exact --model PATH [--target int8] [--reference float32] [options]

One model file in two activation modes, in this process, compared over the whole vocabulary as
`llama-perplexity --kl-divergence` compares a file with its F16/F32 reference: the text (default
tools/quality_texts/alice_in_wonderland.txt) is tokenized, cut into chunks of --ctx tokens (each
starting with BOS where the vocabulary adds one, as llama-perplexity's do), and the second half of
each chunk is scored (every scored token has at least ctx/2 of context), so the
numbers stand beside llama-perplexity's on the same text and -c. Reported: each mode's perplexity,
their ratio, the mean, 99th-percentile and largest KL(reference || target) of the next-token
distributions, and the top-1 agreement. The served tool (python -m tools.quality) sees only each
position's top-k; this one sees every logit.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

from agent.process_env import set_process_defaults
from config.schema import PROJECT_ROOT, resolve_path
from tools.quality.__main__ import DEFAULT_TEXT

MODES = ("float32", "int8")
MAX_CTX = 4096  # every row's logits of a chunk are held at once: ctx x vocabulary floats


def log_softmax(logits: np.ndarray) -> np.ndarray:
    x = logits.astype(np.float64)
    x -= x.max(axis=1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=1, keepdims=True))


def build(model: Path, mode: str, ctx: int, config_dir: Path):
    """A runner of `model` in activation `mode`, one slot of ctx positions, checked by its warm-up."""
    from agent.bootstrap import Placement, build_runner, init_device
    from config import load_config

    path = config_dir / f"exact_{mode}.yaml"
    runtime = {
        "num_slots": 1,
        "max_seq_len": 2 * ctx,
        "memory_budget_mb": None,
        "prefill_buckets": [ctx],
        "decode_batch_buckets": [1],
        "attend_buckets": [2 * ctx],
        "compile_cache_dir": None,
        "activations": mode,
        "speculation": {"method": "none"},
    }
    path.write_text(json.dumps({"model": {"path": str(model)}, "runtime": runtime}))
    config, place = load_config(str(path)), Placement("quality")
    init_device(config, place)
    runner, _ = build_runner(config, place, lambda line: print(line, file=sys.stderr))
    return runner


def chunk_rows(runner, ids: np.ndarray) -> np.ndarray:
    """Log-probabilities of the next token at every position of the chunk's second half but its last."""
    table = runner.padded_table(0, None, len(ids))
    logits = runner.graphs.prefill(table, ids, len(ids), start=0, slot=0, every_row=True).asnumpy()
    return log_softmax(logits[len(ids) // 2 : len(ids) - 1])


def compare(runners: dict, tokens: np.ndarray, ctx: int, chunks: int, bos: int | None = None) -> dict:
    """`bos`: the id each chunk's first token is replaced with, as llama-perplexity does where the
    vocabulary adds one (Gemma: without it every chunk is scored as if cut from mid-text)."""
    target, reference = runners["target"], runners["reference"]
    kl: list[np.ndarray] = []
    agree, nll_t, nll_r = 0, 0.0, 0.0
    for c in range(chunks):
        ids = tokens[c * ctx : (c + 1) * ctx].copy()
        if bos is not None:
            ids[0] = bos
        following = ids[ctx // 2 + 1 :]
        p, q = chunk_rows(reference, ids), chunk_rows(target, ids)
        kl.append((np.exp(p) * (p - q)).sum(axis=1))
        agree += int(np.count_nonzero(p.argmax(1) == q.argmax(1)))
        rows = np.arange(len(following))
        nll_r -= float(p[rows, following].sum())
        nll_t -= float(q[rows, following].sum())
        done = np.concatenate(kl)
        print(f"chunk {c + 1}/{chunks}: mean KLD {done.mean():.6f}", file=sys.stderr, flush=True)
    values = np.concatenate(kl)
    n = len(values)
    return {
        "positions": n,
        "perplexity": float(np.exp(nll_t / n)),
        "reference_perplexity": float(np.exp(nll_r / n)),
        "perplexity_ratio": float(np.exp((nll_t - nll_r) / n)),
        "kl_mean": float(values.mean()),
        "kl_p99": float(np.percentile(values, 99)),
        "kl_max": float(values.max()),
        "top1_agreement": agree / n,
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m tools.quality.exact", description=__doc__.split("\n\n")[1])
    p.add_argument("--model", type=Path, required=True, help="a model file or folder the agents load")
    p.add_argument("--target", choices=MODES, default="int8", help="activations measured (default int8)")
    p.add_argument("--reference", choices=MODES, default="float32", help="activations compared with")
    p.add_argument("--text", type=Path, default=DEFAULT_TEXT, help="a UTF-8 text file")
    p.add_argument(
        "--ctx", type=int, default=512, help="tokens a chunk, as llama-perplexity's -c (default 512)"
    )
    p.add_argument("--chunks", type=int, help="score at most this many chunks (default: all)")
    p.add_argument("--out", type=Path, default=PROJECT_ROOT / "output" / "quality")
    p.add_argument("--name", default=time.strftime("exact-%Y%m%d-%H%M%S"), help="output file stem")
    args = p.parse_args(argv)
    if not 4 <= args.ctx <= MAX_CTX or args.ctx % 2:
        p.error(f"--ctx: an even number from 4 to {MAX_CTX}")
    if args.chunks is not None and args.chunks < 1:
        p.error("--chunks: at least 1")
    if args.target == args.reference:
        p.error("--target and --reference must differ")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    set_process_defaults()
    from agent.model.tokenizer import load_tokenizer

    model = resolve_path(args.model)
    try:
        text = args.text.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    tokenizer = load_tokenizer(model)
    tokens = np.array(tokenizer.encode(text), np.int64)
    added = tokenizer.encode("")  # [BOS] where the vocabulary adds one
    chunks = min(len(tokens) // args.ctx, args.chunks or len(tokens))
    if chunks < 1:
        print(
            f"error: {args.text}: {len(tokens)} tokens, fewer than one chunk of {args.ctx}", file=sys.stderr
        )
        return 1
    args.out.mkdir(parents=True, exist_ok=True)
    runners = {
        side: build(model, getattr(args, side), args.ctx, args.out) for side in ("target", "reference")
    }
    result = {
        "model": str(model),
        "target": args.target,
        "reference": args.reference,
        "text": str(args.text),
        "ctx": args.ctx,
        "chunks": chunks,
    } | compare(runners, tokens, args.ctx, chunks, added[0] if added else None)
    print("| metric | value |\n|---|---|")
    for key, value in result.items():
        print(f"| {key} | {value:.6g} |" if isinstance(value, float) else f"| {key} | {value} |")
    path = args.out / f"{args.name}.json"
    path.write_text(json.dumps(result, indent=2))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
