"""How often a config's greedy answers equal the default config's in float32 activations: the
agreement rate of arithmetic that changes answers (runtime.activations: int8, auto's choice for a
quantized GGUF) with the float32 path, which the tests hold equal to the independent fp32 reference.
A baseline left on auto runs float32; one set to int8 stays int8.

python -m tools.agreement --config CONFIG [--against config/default.yaml] [--tokens 64] [--batch 16]

Each prompt of the bench's prompt file (--prompts: JSONL, a "prompt" per line; or --prompt-words N
words of its text, as the bench's long prompts) as a chat's first turn, `--batch` of them decoded
together; greedy, `--tokens` tokens each (ignoring EOS, so every answer is as long). Prints each
answer's first differing token and the shares of answers identical and of tokens before the first
difference; writes output/agreement.json. Under int8, calls of more than 4 rows take int8
products: each prompt of more than 4 tokens, and decode steps of more than 4 streams (--batch 16
against --batch 4).
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
from pathlib import Path

from agent.process_env import set_process_defaults

set_process_defaults()  # before MindSpore loads
from agent.activations import exact  # noqa: E402
from agent.bootstrap import Placement, build_runner, init_device  # noqa: E402
from agent.contract.sampling import SamplingParams  # noqa: E402
from agent.contract.step import StepChunk, StepRequest  # noqa: E402
from agent.model.formats import load_checkpoint  # noqa: E402
from agent.model.tokenizer import load_tokenizer  # noqa: E402
from config import PROJECT_ROOT, ServingConfig, load_config  # noqa: E402
from tools.bench.__main__ import background_prompt  # noqa: E402
from tools.bench.options import WORKLOADS  # noqa: E402

OUTPUT = PROJECT_ROOT / "output" / "agreement.json"


def answers(config: ServingConfig, prompts: list[list[int]], tokens: int, batch: int) -> list[list[int]]:
    """Greedy `tokens` tokens after each prompt, `batch` prompts decoded together."""
    init_device(config, Placement("agreement"))
    runner, _ = build_runner(config, Placement("agreement"), lambda line: print(line, file=sys.stderr))
    if batch > runner.runtime.planned_num_slots:
        raise SystemExit(f"--batch {batch} exceeds the config's {runner.runtime.planned_num_slots} slots")
    block = runner.runtime.block_size
    blocks = -(-(max(map(len, prompts)) + tokens) // block)  # a table's blocks, slot s's from s * blocks
    out: list[list[int]] = []
    for first in range(0, len(prompts), batch):
        group = prompts[first : first + batch]
        slots = list(range(len(group)))
        tables = [list(range(slot * blocks, (slot + 1) * blocks)) for slot in slots]
        got = []
        for slot, prompt, table in zip(slots, group, tables):
            prompt_chunk = StepChunk(slot, prompt, table, 0, SamplingParams())
            (opening,) = runner.execute(StepRequest(chunks=[prompt_chunk])).firsts
            assert opening is not None  # a chunk with sampling parameters samples
            got.append([opening.token])
        for _ in range(tokens - 1):
            reply = runner.execute(StepRequest(slots=slots, tables=tables))
            for answer, (sampled,) in zip(got, reply.decoded):
                answer.append(sampled.token)
        for slot in slots:
            runner.release(slot)
        out += got
    del runner
    gc.collect()
    return out


def first_difference(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, help="the config whose answers are compared")
    parser.add_argument("--against", help="the baseline config (default: config/default.yaml)")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument(
        "--prompts", type=Path, default=WORKLOADS["normal"], help='JSONL with a "prompt" per line'
    )
    parser.add_argument("--prompt-words", type=int, default=0, metavar="N")
    args = parser.parse_args()
    config, baseline = load_config(args.config), load_config(args.against)
    if baseline.runtime.activations == "auto":
        baseline = exact(baseline)
    if config.model.path != baseline.model.path:
        raise SystemExit("the two configs serve different models")
    texts = [json.loads(line)["prompt"] for line in args.prompts.read_text().splitlines() if line.strip()]
    if args.prompt_words:
        texts = [background_prompt(texts, args.prompt_words, start=i * 997) for i in range(len(texts))]
    tokenizer = load_tokenizer(config.model.path)
    tokenizer.check_fits(load_checkpoint(config.model.path).spec.vocab_size)
    prompts = [tokenizer.encode_chat([{"role": "user", "content": text}]) for text in texts]
    want = answers(baseline, prompts, args.tokens, args.batch)
    got = answers(config, prompts, args.tokens, args.batch)
    rows = []
    for prompt, a, b in zip(prompts, got, want):
        at = first_difference(a, b)
        rows.append({"prompt_tokens": len(prompt), "first_difference": at})
        shown = "identical"
        if at is not None:
            was, now = tokenizer.decode(b[at : at + 8]), tokenizer.decode(a[at : at + 8])
            shown = f"differs from token {at}: {was!r} -> {now!r}"
        print(f"{len(prompt):5d} prompt tokens: {shown}")
    identical = sum(r["first_difference"] is None for r in rows) / len(rows)
    before = sum(args.tokens if r["first_difference"] is None else r["first_difference"] for r in rows)
    summary = {
        "config": args.config,
        "against": args.against or "config/default.yaml",
        "tokens": args.tokens,
        "batch": args.batch,
        "prompt_words": args.prompt_words,
        "answers_identical": identical,
        "tokens_before_first_difference": before / (args.tokens * len(rows)),
        "answers": rows,
    }
    print(
        f"{len(rows)} answers of {args.tokens} tokens: {identical:.0%} identical, "
        f"{summary['tokens_before_first_difference']:.1%} of tokens before the first difference"
    )
    OUTPUT.parent.mkdir(exist_ok=True)
    OUTPUT.write_text(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
