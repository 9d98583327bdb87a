"""The benchmark's command line: its options, their checks, and the named workloads' prompt files."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from config.schema import PROJECT_ROOT
from tools.bench.targets import Target, TargetError

# The prompt files of the named workloads: chat-style questions, and copy-heavy ones (a ~500-token
# document and an instruction to return it with small edits or to extract its sentences: what
# speculative decoding's prompt lookup proposes well).
WORKLOADS = {
    "normal": Path(__file__).with_name("prompts.jsonl"),
    "copy": Path(__file__).with_name("copy_prompts.jsonl"),
}
HOSTILE_KINDS = ("stop_flood", "huge_prompt", "full_vocab", "greedy")  # greedy: the control
DEFAULT_HOSTILE_KINDS = "stop_flood,huge_prompt,full_vocab"
HUGE_PROMPT_BYTES = 1 << 20


def int_list(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v]


def float_list(text: str) -> list[float]:
    return [float(v) for v in text.split(",") if v]


def hostile_kinds(text: str) -> list[str]:
    kinds = [v for v in text.split(",") if v]
    unknown = [k for k in kinds if k not in HOSTILE_KINDS]
    if unknown or not kinds:
        raise argparse.ArgumentTypeError(f"hostile kinds {text!r}: choose from {','.join(HOSTILE_KINDS)}")
    return kinds


def output_lengths(spec: str) -> tuple[int, int]:
    low_text, _, high_text = spec.partition(":")
    low, high = int(low_text), int(high_text or low_text)
    if not 1 <= low <= high:
        raise argparse.ArgumentTypeError(f"output length {spec!r}: want N or MIN:MAX with 1 <= MIN <= MAX")
    return low, high


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m tools.bench",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__,
    )
    p.add_argument(
        "--target",
        action="append",
        default=[],
        metavar="[LABEL=]URL",
        help="a server: http://H:P/models/NAME (native), .../v1/completions or "
        ".../v1/chat/completions (OpenAI); repeatable",
    )
    p.add_argument(
        "--vs",
        action="append",
        default=[],
        metavar="[LABEL=]URL",
        help="another server to run in alternation with the first (same as --target)",
    )
    p.add_argument(
        "--concurrency",
        type=int_list,
        default=[1, 2, 4, 8, 16, 32],
        help="closed-loop levels, comma-separated (default 1,2,4,8,16,32)",
    )
    p.add_argument("--rate", type=float_list, help="open loop instead: Poisson arrival rates, req/s")
    p.add_argument(
        "--requests",
        type=int,
        help="requests per run (default: 2 x the concurrency, at least 4; open loop 32)",
    )
    p.add_argument(
        "--output-len",
        type=output_lengths,
        default=(128, 128),
        metavar="N|MIN:MAX",
        help="new tokens per request, fixed or sampled uniformly (default 128)",
    )
    p.add_argument(
        "--unique-prompts",
        action=argparse.BooleanOptionalAction,
        default=True,
        help='number each request\'s prompt ("[run.17] ...") so no server answers from a '
        "cache of an earlier identical prompt (llama.cpp's server keeps one per slot); "
        "--no-unique-prompts sends the prompt file's texts as they are",
    )
    p.add_argument(
        "--stop-at-eos",
        action="store_true",
        help="let answers end at EOS (default: ignore_eos, so every request makes N tokens)",
    )
    p.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="runs per (target, level); the report shows each metric's median",
    )
    p.add_argument("--warmup", type=int, default=2, help="untimed requests per target first")
    p.add_argument(
        "--settle",
        type=float,
        default=3.0,
        help="seconds of quiet before each timed run: a server that just ran keeps spinning threads "
        "for a while (vLLM's CPU worker ~1 s on one core), which would tax the next target's run",
    )
    p.add_argument("--model", help="the `model` field for OpenAI targets (default: their first /v1/models)")
    p.add_argument(
        "--workload",
        choices=sorted(WORKLOADS),
        default="normal",
        help="the prompts: normal (chat questions) or copy (a document to return edited or to "
        "extract from); --prompts gives a file instead",
    )
    p.add_argument("--prompts", type=Path, help='JSONL with a "prompt" per line (default: the --workload\'s)')
    p.add_argument(
        "--background-words",
        type=int,
        metavar="N",
        help="during each run, also send a prompt of N words (1 new token) every "
        "--background-interval seconds; they are reported apart",
    )
    p.add_argument("--background-interval", type=float, default=2.0, metavar="S")
    p.add_argument(
        "--prompt-words",
        type=int,
        metavar="N",
        help="long prompts: each request's prompt is N words of the prompt file's text (each "
        "starting elsewhere in it) instead of one of its prompts",
    )
    p.add_argument(
        "--shared-prefix-words",
        type=int,
        metavar="N",
        help="shared-prefix traffic: every request of a run starts with the same N-word system "
        "text, then its own question; reports the first request's TTFT apart from the rest's",
    )
    p.add_argument(
        "--turns",
        type=int,
        metavar="T",
        help="multi-turn chats: each client holds chats of T turns, each turn's prompt the chat "
        "so far (earlier prompts and their answers) and a new question; reports first and later "
        "turns' TTFT apart",
    )
    p.add_argument(
        "--hostile",
        type=int,
        default=0,
        metavar="N",
        help="during each run, also keep N hostile clients busy, back to back, cycling "
        "--hostile-kinds; they are reported apart, by kind and status",
    )
    p.add_argument(
        "--hostile-kinds",
        type=hostile_kinds,
        default=hostile_kinds(DEFAULT_HOSTILE_KINDS),
        metavar="K,K",
        help=f"from {','.join(HOSTILE_KINDS)} (default {DEFAULT_HOSTILE_KINDS}; greedy is a "
        "benign control of the same length)",
    )
    p.add_argument(
        "--hostile-len",
        type=int,
        default=256,
        metavar="N",
        help="new tokens per hostile answer (default 256)",
    )
    p.add_argument(
        "--extra-body",
        action="append",
        default=[],
        metavar="[LABEL=]JSON",
        help="fields added to every request to that target (all targets without LABEL); for the native "
        'API, to its parameters: e.g. \'json={"structured_outputs": {"json": {...}}}\'; repeatable',
    )
    p.add_argument("--api-key", help="sent by the timed clients as Authorization: Bearer KEY")
    p.add_argument(
        "--hostile-api-key",
        help="the hostile clients' key (default --api-key): another key than the timed clients' "
        "measures the fairness between clients (scheduler.client_share)",
    )
    p.add_argument("--seed", type=int, default=0, help="prompt order and sampled lengths")
    p.add_argument("--out", type=Path, default=PROJECT_ROOT / "output" / "bench")
    p.add_argument("--name", default=time.strftime("bench-%Y%m%d-%H%M%S"), help="output file stem")
    args = p.parse_args(argv)
    args.prompts = args.prompts or WORKLOADS[args.workload]
    specs = args.target + args.vs
    if not specs:
        p.error("give at least one --target")
    try:
        args.targets = [Target.parse(s) for s in specs]
    except TargetError as exc:
        p.error(str(exc))
    if len({t.label for t in args.targets}) != len(args.targets):
        p.error("two targets share a label; name them with LABEL=URL")
    try:
        args.targets = [
            t.with_extra(extra_fields(args.extra_body, t.label)).with_key(args.api_key) for t in args.targets
        ]
    except (TargetError, ValueError) as exc:
        p.error(f"--extra-body: {exc}")
    if args.hostile < 0 or args.hostile_len < 1:
        p.error("--hostile must be 0 or more and --hostile-len at least 1")
    return args


def load_prompts(path: Path) -> list[str]:
    prompts = [json.loads(line)["prompt"] for line in path.read_text().splitlines() if line.strip()]
    if not prompts:
        raise SystemExit(f"error: no prompts in {path}")
    return prompts


def extra_fields(specs: list[str], label: str) -> dict:
    """The --extra-body fields for the target `label`: those without a label, then its own."""
    fields: dict = {}
    for spec in specs:
        labelled = "=" in spec and not spec.lstrip().startswith(("{", "["))
        own, text = spec.split("=", 1) if labelled else ("", spec)
        if own and own != label:
            continue
        value = json.loads(text)
        if not isinstance(value, dict):
            raise TargetError(f"{spec!r} is not a JSON object")
        fields.update(value)
    return fields
