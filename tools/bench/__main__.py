"""python -m tools.bench --target URL [--vs URL ...] [options]

Closed-loop sweep (default): at each concurrency level, that many clients send streaming requests
back to back. Open loop (--rate): requests arrive as a Poisson process. With several targets the
runs alternate target by target at each level, so drift on a shared machine hits all of them alike;
--repeats runs each (target, level) several times and reports the median of each metric.
--background-words N sends a long prompt (N words, one new token) every --background-interval
seconds during each timed run: decoding streams under a steady stream of prefills (their TTFT is
reported as background_ttft_*). --hostile N keeps N hostile clients busy during each timed run,
cycling --hostile-kinds: stop_flood (the most stop strings a server accepts, 4 of 256 characters,
never matching, a long answer), huge_prompt (a 1 MiB prompt: a defended server answers 413 at
once), full_vocab (temperature 1 over the whole vocabulary, a long answer); greedy (a plain long
answer) is a control of the same size. Hostile requests are counted by kind and status apart
(hostile_* in the JSON, a second table in the markdown); the timed streams' metrics are their own.
Results go to output/bench/<name>.{json,md,png}.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import random
import secrets
import sys
import time
from collections.abc import Awaitable, Iterator
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families
from tqdm import tqdm

from agent.contract.sampling import MAX_STOP_CHARS, MAX_STOP_STRINGS
from agent.kernels import host_cpu, target, target_macros
from tools.bench import report
from tools.bench.load import (
    HostileRequest,
    chat_loop,
    closed_loop,
    open_loop,
    with_background,
    with_hostile,
)
from tools.bench.options import HUGE_PROMPT_BYTES, load_prompts, parse_args
from tools.bench.stats import RequestRecord, median_of_runs, speculation, summarize, summarize_hostile
from tools.bench.targets import Target


def speculation_counters(target: Target) -> tuple[float, float] | None:
    """Speculative decoding's (proposed, accepted) token counters from the target's /metrics, where
    it exports this project's (llm_serving_spec_*); None elsewhere."""
    try:
        reply = httpx.get(target.metrics_url, headers=target.headers, timeout=10)
    except httpx.HTTPError:
        return None
    if reply.status_code != 200:
        return None
    counts: dict[str, float] = {}
    for family in text_string_to_metric_families(reply.text):
        for sample in family.samples:
            if sample.name in (
                "llm_serving_spec_proposed_tokens_total",
                "llm_serving_spec_accepted_tokens_total",
            ):
                counts[sample.name] = counts.get(sample.name, 0.0) + sample.value
    if len(counts) != 2:
        return None
    return counts["llm_serving_spec_proposed_tokens_total"], counts["llm_serving_spec_accepted_tokens_total"]


def openai_model(target: Target) -> str | None:
    base = target.url.split("/v1/")[0]
    try:
        models = httpx.get(f"{base}/v1/models", headers=target.headers, timeout=10).json()["data"]
        return models[0]["id"] if models else None
    except (httpx.HTTPError, KeyError, ValueError):
        return None


def request_bodies(target: Target, args, prompts: list[str], model: str | None, run: str = "0"):
    """An endless, seeded stream of request bodies: the same sequence for every target. With
    --unique-prompts each prompt starts with `[run.N]`: give every run of one invocation its own
    `run` (the same for each target) and no prompt is ever sent to a server twice."""
    rng = random.Random(args.seed)
    low, high = args.output_len
    for prompt in prompt_texts(args, prompts, run, rng):
        yield target.request_body(prompt, rng.randint(low, high), not args.stop_at_eos, model)


def prompt_texts(args, prompts: list[str], run: str, rng: random.Random) -> Iterator[str]:
    """The timed prompts, seeded: the prompt file's (or --prompt-words long ones), after the run's
    shared system text with --shared-prefix-words; numbered with --unique-prompts (after the
    shared text, which must stay the same)."""
    order = prompts[:]
    rng.shuffle(order)
    shared = (
        f"[{run}] System: {background_prompt(prompts, args.shared_prefix_words)}\n\n"
        if args.shared_prefix_words
        else ""
    )
    for number, prompt in enumerate(itertools.cycle(order)):
        if args.prompt_words:
            prompt = background_prompt(prompts, args.prompt_words, start=number * 997)
        if args.unique_prompts:
            prompt = f"[{run}.{number}] {prompt}"
        yield shared + prompt


def chats(args, prompts: list[str], run: str) -> tuple[Iterator[str], Iterator[str]]:
    """Openers (the timed prompts as a chat's first user turn) and the follow-up questions."""
    texts = prompt_texts(args, prompts, run, random.Random(args.seed))
    return (f"User: {text}\nAssistant:" for text in texts), itertools.cycle(prompts)


def background_prompt(prompts: list[str], words: int, start: int = 0) -> str:
    """`words` words of the prompt file's text, from word `start` on (cycling)."""
    pool = " ".join(prompts).split()
    return " ".join(itertools.islice(itertools.cycle(pool), start % len(pool), start % len(pool) + words))


def never_matching_stops() -> list[str]:
    """The most stop strings a request may carry (agent.contract.sampling: 4, of 256 characters
    each, as OpenAI and TGI allow), each ending in U+241E (SYMBOL FOR RECORD SEPARATOR), which no
    answer writes: the server scans for them after every token and never finds one."""
    return [
        (f"{i}: and so the answer goes on " * 16)[: MAX_STOP_CHARS - 1] + "\u241e"
        for i in range(MAX_STOP_STRINGS)
    ]


def huge_prompt_body(target: Target, prompts: list[str], max_tokens: int, model: str | None) -> bytes:
    """A request whose prompt is HUGE_PROMPT_BYTES of UTF-8 text (so its body is larger still),
    encoded once: it is sent many times."""
    text = " ".join(prompts).encode()
    while len(text) < HUGE_PROMPT_BYTES:
        text += b" " + text
    prompt = text[:HUGE_PROMPT_BYTES].decode(errors="ignore")
    body = target.request_body(prompt, max_tokens, True, model)
    return json.dumps(body, ensure_ascii=False).encode()


def hostile_requests(
    target: Target, args, prompts: list[str], model: str | None, run: str = "0"
) -> Iterator[HostileRequest]:
    """An endless stream of hostile requests, cycling args.hostile_kinds (numbered prompts, as
    request_bodies() numbers them, with an `h`)."""
    stops = never_matching_stops()
    huge = (
        huge_prompt_body(target, prompts, args.hostile_len, model)
        if "huge_prompt" in args.hostile_kinds
        else b""
    )
    pairs = zip(itertools.cycle(args.hostile_kinds), itertools.cycle(prompts))
    for number, (kind, prompt) in enumerate(pairs):
        if kind == "huge_prompt":
            yield HostileRequest(kind, huge, 413)
            continue
        body = target.request_body(
            f"[{run}.h{number}] {prompt}",
            args.hostile_len,
            True,
            model,
            stop=stops if kind == "stop_flood" else None,
            full_vocab=kind == "full_vocab",
        )
        yield HostileRequest(kind, body, 200)


def timed_run(
    target: Target,
    args,
    level,
    bodies,
    per_run: int,
    done,
    background: tuple[str, str] | None,
    model: str | None,
    hostile: Iterator[HostileRequest] | None = None,
    chats: tuple[Iterator[str], Iterator[str]] | None = None,
) -> dict:
    """One timed run at `level` -> its summary (with the background prompts' and the hostile
    requests' apart, if any); `chats`: (openers, follow-up questions) of multi-turn chats."""
    if args.rate:
        load = open_loop(target, bodies, level, per_run, args.seed, done)
    elif chats is not None:
        openers, questions = chats
        load = chat_loop(
            target,
            lambda prompt: target.request_body(prompt, args.output_len[1], not args.stop_at_eos, model),
            openers,
            questions,
            args.turns,
            level,
            per_run,
            done,
        )
    else:
        load = closed_loop(target, bodies, level, per_run, done)
    sides: dict[str, Any] = {}

    async def keep(key: str, together: Awaitable[tuple[Any, Any]]) -> Any:
        result, sides[key] = await together
        return result

    timed: Awaitable[tuple[list[RequestRecord], float]] = load
    if background is not None:
        # Numbered like the timed prompts: a prefix cache must not answer one from the last.
        bodies_of_background = (
            target.request_body(f"[{background[0]}.bg{number}] {background[1]}", 1, True, model)
            for number in itertools.count()
        )
        timed = keep(
            "background", with_background(timed, target, bodies_of_background, args.background_interval)
        )
    if hostile is not None and args.hostile:
        hostile_target = target.with_key(args.hostile_api_key or args.api_key)
        timed = keep("hostile", with_hostile(timed, hostile_target, hostile, args.hostile))

    async def measured() -> tuple[list[RequestRecord], float]:
        return await timed

    before = speculation_counters(target)
    records, wall = asyncio.run(measured())
    summary = summarize(records, wall)
    after = speculation_counters(target)
    if before is not None and after is not None:  # the server's own counts (this project's /metrics)
        summary.update(speculation(after[0] - before[0], after[1] - before[1]))
    if "background" in sides:
        side = summarize(sides["background"], wall)
        summary.update(
            {
                f"background_{key}": side[key]
                for key in ("requests", "errors", "ttft_p50_s", "ttft_p90_s", "ttft_p99_s")
            }
        )
        # the rate the prompts met: the window, not the interval, decides how many arrive in it
        summary["background_per_min"] = 60 * side["requests"] / wall if wall > 0 else 0.0
    if "hostile" in sides:
        outcomes, health = sides["hostile"]
        summary.update(summarize_hostile(outcomes, args.hostile_kinds, health))
    return summary


def warm_up(target: Target, args, prompts: list[str], model: str | None, tag: str, done) -> str | None:
    """`args.warmup` requests one at a time, untimed -> the first error, or None."""
    if not args.warmup:
        return None
    bodies = request_bodies(target, args, prompts, model, tag)
    records, _ = asyncio.run(closed_loop(target, bodies, 1, args.warmup, done))
    return next((r.error for r in records if r.error), None)


def machine() -> str:
    """This host's CPU and its kernel target (this shell's MS_LLM_KERNEL_TARGET: start the servers
    from the same shell, or the table names another target than theirs)."""
    kernel_target = target()
    return host_cpu.describe(kernel_target, target_macros(kernel_target))


def print_tables(results: list[dict[str, Any]], args) -> None:
    """The summary table, then those the run's options call for."""
    print(report.markdown_table(results))
    if args.shared_prefix_words or args.turns:
        print(report.ttft_split_table(results))
    if args.hostile:
        print(report.hostile_table(results))
    speculated = report.speculation_table(results)
    if speculated:
        print(speculated)


def main(argv=None) -> int:
    args = parse_args(argv)
    prompts = load_prompts(args.prompts)
    models = {t.label: (args.model or openai_model(t)) if t.api != "native" else None for t in args.targets}
    open_mode = bool(args.rate)
    levels = args.rate if open_mode else args.concurrency
    per_run = {level: args.requests or (32 if open_mode else max(4, 2 * level)) for level in levels}
    total = len(args.targets) * (args.warmup + args.repeats * sum(per_run.values()))
    secret = ("targets", "api_key", "hostile_api_key")  # no keys in the results
    settings = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k not in secret}
    settings["targets"] = [{k: v for k, v in vars(t).items() if k != "headers"} for t in args.targets]
    settings["machine"] = machine()

    background = background_prompt(prompts, args.background_words) if args.background_words else None
    invocation = secrets.token_hex(3)  # prompts differ from those of earlier invocations too
    results: list[dict[str, Any]] = []
    with tqdm(total=total, unit="req", file=sys.stderr) as bar:

        def done():
            bar.update()

        for target in args.targets:
            bar.set_description(f"warm-up {target.label}")
            failed = warm_up(target, args, prompts, models[target.label], f"{invocation}-w", done)
            if failed:
                print(f"error: {target.label} ({target.url}) failed its warm-up: {failed}", file=sys.stderr)
                return 1
        runs: dict[tuple[str, float], list[dict]] = {}
        run_tags = (f"{invocation}-{i}" for i in itertools.count())
        for level in levels:
            for _ in range(args.repeats):
                tag = next(run_tags)
                for number, target in enumerate(args.targets):  # alternate: every target sees the same drift
                    bar.set_description(f"{target.label} @ {level:g}{' req/s' if open_mode else ' streams'}")
                    time.sleep(args.settle)
                    # each target's own tag, of one length: two targets on one server (an option on
                    # and off) must not answer the second from the first one's prompts in its cache
                    run = f"{tag}.{number:02d}"
                    bodies = request_bodies(target, args, prompts, models[target.label], run)
                    hostile = (
                        hostile_requests(target, args, prompts, models[target.label], run)
                        if args.hostile
                        else None
                    )
                    runs.setdefault((target.label, level), []).append(
                        timed_run(
                            target,
                            args,
                            level,
                            bodies,
                            per_run[level],
                            done,
                            None if background is None else (run, background),
                            models[target.label],
                            hostile,
                            chats(args, prompts, run) if args.turns else None,
                        )
                    )
        for (label, level), level_runs in runs.items():
            results.append(
                {
                    "target": label,
                    "level": level,
                    "x": level,
                    "x_label": "arrival rate (req/s)" if open_mode else "concurrent streams",
                    "summary": median_of_runs(level_runs),
                    "runs": level_runs,
                }
            )
    results.sort(key=lambda r: (r["level"], [t.label for t in args.targets].index(r["target"])))
    paths = report.write(results, settings, args.out, args.name)
    print(f"Machine: {settings['machine']}\n")
    print_tables(results, args)
    print("wrote " + ", ".join(str(p) for p in paths.values()))
    return 1 if any(r["summary"]["errors"] for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
