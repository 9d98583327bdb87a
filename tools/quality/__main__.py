"""python -m tools.quality --target URL [--reference URL] [options]

A model's quality as a server computes it, from prompt logprobs: the text (--text, default
tools/quality_texts/alice_in_wonderland.txt, ~39,000 tokens on the default model's vocabulary) is
tokenized by the target's /tokenize, cut into windows of --window tokens every --stride tokens, and
each window is sent as a token-id prompt to /v1/completions with echo and max_tokens 0. Scored: each
window's tokens after its first, and after the first window only those past the previous window's
end (so with --stride < --window every scored token has at least window - stride tokens of context).

Reported: the target's perplexity, exp of the mean negative logprob of the scored tokens; with a
--reference (another server, or the same model served another way, on the same vocabulary: the
target's token ids are sent to both), its perplexity, the mean and 99th-percentile KL divergence
KL(reference || target) of each position's next-token distribution in its top-k approximation
(tools/quality/metrics.py), and the top-1 agreement (the share of positions where both sides' most
likely next token is the same). A markdown table goes to stdout, JSON to output/quality/<name>.json.
A server without a tokenizer endpoint or prompt logprobs: a message and exit status 1.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from config.schema import PROJECT_ROOT
from tools.quality.client import QualityError, Server
from tools.quality.metrics import Position, summary

DEFAULT_TEXT = PROJECT_ROOT / "tools" / "quality_texts" / "alice_in_wonderland.txt"
MAX_TOP_K = 20  # vLLM's and this project's bound on prompt_logprobs


def windows(tokens: int, window: int, stride: int, most: int | None) -> list[tuple[int, int, int]]:
    """(start, end, first scored index within the window) of each window over `tokens` tokens; a
    window scoring nothing is left out."""
    spans: list[tuple[int, int, int]] = []
    scored_to = 0  # the tokens before this are scored
    for start in range(0, max(tokens - 1, 0), stride):
        end = min(start + window, tokens)
        first = max(1, scored_to - start)
        if end - start > first:
            spans.append((start, end, first))
            scored_to = end
        if end == tokens or (most is not None and len(spans) == most):
            break
    return spans


def measure(
    target: Server, reference: Server | None, ids: list[int], args: argparse.Namespace
) -> tuple[list[Position], list[Position] | None]:
    scored: list[Position] = []
    reference_scored: list[Position] | None = [] if reference else None
    spans = windows(len(ids), args.window, args.stride, args.max_windows)
    for number, (start, end, first) in enumerate(spans, 1):
        print(f"window {number}/{len(spans)}: tokens {start}..{end - 1}", file=sys.stderr, flush=True)
        prompt = ids[start:end]
        scored += target.score(prompt, args.top_k)[first - 1 :]  # score() starts at index 1
        if reference and reference_scored is not None:
            reference_scored += reference.score(prompt, args.top_k)[first - 1 :]
    return scored, reference_scored


def markdown(result: dict) -> str:
    rows = [
        ("tokens scored", "tokens_scored", "{:d}"),
        ("windows", "windows", "{:d}"),
        ("perplexity", "perplexity", "{:.4f}"),
        ("reference perplexity", "reference_perplexity", "{:.4f}"),
        ("mean KL (top-k approx.)", "kl_mean", "{:.6f}"),
        ("99th pct KL", "kl_p99", "{:.6f}"),
        ("top-1 agreement", "top1_agreement", "{:.4f}"),
    ]
    lines = ["| metric | value |", "|---|---|"]
    lines += [f"| {name} | {fmt.format(result[key])} |" for name, key, fmt in rows if key in result]
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m tools.quality", description=__doc__.split("\n\n")[1])
    p.add_argument("--target", required=True, help="OpenAI base URL, e.g. http://127.0.0.1:9811/v1")
    p.add_argument("--reference", help="a second server (same vocabulary) to compare with")
    p.add_argument("--model", help="model name for both servers (default: each one's first /v1/models)")
    p.add_argument("--api-key", help="sent as Authorization: Bearer to both servers")
    p.add_argument("--text", type=Path, default=DEFAULT_TEXT, help="a UTF-8 text file")
    p.add_argument("--window", type=int, default=512, help="tokens a request (default 512)")
    p.add_argument("--stride", type=int, help="tokens between window starts (default: --window)")
    p.add_argument("--top-k", type=int, default=5, help=f"next tokens compared, 1 to {MAX_TOP_K} (default 5)")
    p.add_argument("--max-windows", type=int, help="score at most this many windows")
    p.add_argument("--out", type=Path, default=PROJECT_ROOT / "output" / "quality")
    p.add_argument("--name", default=time.strftime("quality-%Y%m%d-%H%M%S"), help="output file stem")
    args = p.parse_args(argv)
    args.stride = args.stride or args.window
    if args.window < 2 or not 1 <= args.stride <= args.window:
        p.error("want --window >= 2 and 1 <= --stride <= --window")
    if not 1 <= args.top_k <= MAX_TOP_K:
        p.error(f"--top-k: 1 to {MAX_TOP_K}")
    if args.max_windows is not None and args.max_windows < 1:
        p.error("--max-windows: at least 1")
    return args


def run(args: argparse.Namespace) -> dict:
    target = Server(args.target, args.model, args.api_key)
    reference = Server(args.reference, args.model, args.api_key) if args.reference else None
    ids = target.tokenize(args.text.read_text(encoding="utf-8"))
    if len(ids) < 2:
        raise QualityError(f"{args.text}: fewer than 2 tokens")
    scored, reference_scored = measure(target, reference, ids, args)
    result = {
        "target": args.target,
        "reference": args.reference,
        "model": target.model,
        "text": str(args.text),
        "text_tokens": len(ids),
        "window": args.window,
        "stride": args.stride,
        "top_k": args.top_k,
        "windows": len(windows(len(ids), args.window, args.stride, args.max_windows)),
    }
    return result | summary(scored, reference_scored)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        result = run(args)
    except (QualityError, OSError, UnicodeDecodeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(markdown(result))
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"{args.name}.json"
    path.write_text(json.dumps(result, indent=2, ensure_ascii=False))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
