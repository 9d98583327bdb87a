"""python -m tools.quality.choice_task --out DIR [--text FILE] [--items N] [--seed S]

A multiple-choice task for lm-evaluation-harness built from a local text, so a server's loglikelihood
accuracy can be scored with no dataset hub: each item is a passage of the text (--context sentences)
and four candidates for the sentence that follows it, the true one and three drawn from elsewhere in
the text. Writes DIR/<name>.jsonl (the items) and DIR/<name>.yaml (the task), then prints the
lm_eval command that scores a server with them through `local-completions` (prompt logprobs with
echo, token-id prompts, and this server's /tokenize for `tokenizer_backend=remote`).
"""

from __future__ import annotations

import argparse
import json
import random
import re
import sys
from pathlib import Path

import yaml

from tools.quality.__main__ import DEFAULT_TEXT

CHOICES = 4
MIN_WORDS, MAX_WORDS = 6, 40  # candidates: sentences long enough to tell apart, short enough to score
# a sentence ends at . ! or ? (and a closing quote), before white space and a capital or quote
SENTENCE_END = re.compile(r"(?:(?<=[.!?])|(?<=[.!?]['\"\u2019\u201d]))\s+(?=['\"\u2018\u201c]?[A-Z])")


def sentences(text: str) -> list[str]:
    """The text's sentences, each on one line of single spaces."""
    flat = " ".join(text.split())
    return [s.strip() for s in SENTENCE_END.split(flat) if s.strip()]


def items(text: str, count: int, context: int, seed: int) -> list[dict]:
    """`count` items, spread over the text: {"context", "choices", "gold"} with the true next
    sentence at index `gold` among CHOICES distinct candidates."""
    found = sentences(text)
    usable = [s for s in found if MIN_WORDS <= len(s.split()) <= MAX_WORDS]
    distinct = set(usable)
    answers = [i for i in range(context, len(found)) if found[i] in distinct]
    if len(answers) < count or len(distinct) < CHOICES:
        raise ValueError(f"the text has {len(answers)} usable sentences, fewer than the {count} items asked")
    rng = random.Random(seed)
    chosen = sorted(rng.sample(answers, count))
    out = []
    for i in chosen:
        truth = found[i]
        others = rng.sample([s for s in usable if s != truth], CHOICES - 1)
        gold = rng.randrange(CHOICES)
        choices = others[:gold] + [truth] + others[gold:]
        out.append({"context": " ".join(found[i - context : i]), "choices": choices, "gold": gold})
    return out


def task_yaml(name: str, data: Path) -> str:
    """lm-evaluation-harness's task config over the local JSON lines file `data`."""
    task = {
        "task": name,
        "dataset_path": "json",
        "dataset_kwargs": {"data_files": {"test": str(data.resolve())}},
        "test_split": "test",
        "output_type": "multiple_choice",
        "doc_to_text": "{{context}}",
        "doc_to_choice": "choices",
        "doc_to_target": "gold",
        "target_delimiter": " ",
        "metric_list": [{"metric": "acc"}, {"metric": "acc_norm"}],
    }
    return yaml.safe_dump(task, sort_keys=False)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m tools.quality.choice_task", description=__doc__.split("\n\n")[1]
    )
    p.add_argument("--out", type=Path, required=True, help="folder for the task's .yaml and .jsonl")
    p.add_argument("--text", type=Path, default=DEFAULT_TEXT, help="a UTF-8 text file")
    p.add_argument("--items", type=int, default=200, help="questions (default 200)")
    p.add_argument("--context", type=int, default=2, help="sentences before each answer (default 2)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--name", default="next_sentence", help="the task's name (default next_sentence)")
    args = p.parse_args(argv)
    if args.items < 1 or args.context < 1:
        p.error("--items and --context: at least 1")
    if not re.fullmatch(r"[A-Za-z0-9_]+", args.name):
        p.error("--name: letters, digits and underscores")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        made = items(args.text.read_text(encoding="utf-8"), args.items, args.context, args.seed)
    except (OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    args.out.mkdir(parents=True, exist_ok=True)
    data = args.out / f"{args.name}.jsonl"
    data.write_text("".join(json.dumps(item, ensure_ascii=False) + "\n" for item in made), encoding="utf-8")
    task = args.out / f"{args.name}.yaml"
    task.write_text(task_yaml(args.name, data), encoding="utf-8")
    print(f"wrote {len(made)} items to {data} and the task to {task}; score a server:")
    print(
        "  lm_eval --model local-completions --model_args base_url=http://127.0.0.1:9811/v1/completions,"
        f"model=default,tokenizer_backend=remote,tokenized_requests=True --include_path {args.out} "
        f"--tasks {args.name}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
