"""Writes a benchmark's results: JSON (everything), a markdown table, a PNG plot (one line per target)."""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402

COLUMNS = [  # (header, key, scale, format)
    ("TTFT p50 ms", "ttft_p50_s", 1000, "{:.0f}"),
    ("TTFT p90 ms", "ttft_p90_s", 1000, "{:.0f}"),
    ("TTFT p99 ms", "ttft_p99_s", 1000, "{:.0f}"),
    ("ITL p50 ms", "itl_p50_s", 1000, "{:.1f}"),
    ("ITL p99 ms", "itl_p99_s", 1000, "{:.1f}"),
    ("E2E p50 s", "latency_p50_s", 1, "{:.2f}"),
    ("E2E p99 s", "latency_p99_s", 1, "{:.2f}"),
    ("out tok/s", "output_tok_s", 1, "{:.1f}"),
    ("req/s", "requests_per_s", 1, "{:.2f}"),
    ("errors", "errors", 1, "{:.0f}"),
]


def table_header(names: list[str]) -> list[str]:
    return ["| " + " | ".join(names) + " |", "|" + "---|" * len(names)]


def table_line(cells: list) -> str:
    return "| " + " | ".join(str(c) for c in cells) + " |"


def formatted(summary: dict, columns: list[tuple], prefix: str = "") -> list[str]:
    """The cells of `columns` ((header, key, scale, format)) from `summary`'s `prefix + key`, "-"
    where a value is missing (None)."""
    cells = []
    for _, key, scale, fmt in columns:
        value = summary[prefix + key]
        cells.append("-" if value is None else fmt.format(value * scale))
    return cells


def markdown_table(results: list[dict]) -> str:
    """One row per (target, level); each cell is the median over the level's runs."""
    lines = table_header(["target", "level", *(c[0] for c in COLUMNS)])
    for row in results:
        lines.append(table_line([row["target"], row["level"], *formatted(row["summary"], COLUMNS)]))
    return "\n".join(lines) + "\n"


TTFT_SPLIT_COLUMNS = [  # (header, key, scale, format)
    ("first TTFT ms", "ttft_first_s", 1000, "{:.0f}"),
    ("rest TTFT p50 ms", "ttft_rest_p50_s", 1000, "{:.0f}"),
    ("first turns p50 ms", "ttft_first_turn_p50_s", 1000, "{:.0f}"),
    ("later turns p50 ms", "ttft_later_turns_p50_s", 1000, "{:.0f}"),
]


def ttft_split_table(results: list[dict]) -> str:
    """Shared-prefix and multi-turn runs: the TTFT of the first request and of first turns, apart
    from the rest (which a prefix cache may serve)."""
    lines = table_header(["target", "level", *(c[0] for c in TTFT_SPLIT_COLUMNS)])
    for row in results:
        lines.append(
            table_line([row["target"], row["level"], *formatted(row["summary"], TTFT_SPLIT_COLUMNS)])
        )
    return "\n".join(lines) + "\n"


BACKGROUND_COLUMNS = [  # (header, key, scale, format)
    ("prompts", "background_requests", 1, "{:.0f}"),
    ("per minute", "background_per_min", 1, "{:.1f}"),
    ("TTFT p50 ms", "background_ttft_p50_s", 1000, "{:.0f}"),
    ("TTFT p99 ms", "background_ttft_p99_s", 1000, "{:.0f}"),
    ("errors", "background_errors", 1, "{:.0f}"),
]


def background_table(results: list[dict]) -> str:
    """The long prompts beside each (target, level) (medians over the runs): how many arrived in
    the timed window, their rate over it, and their TTFT; "" if there were none."""
    lines = table_header(["target", "level", *(c[0] for c in BACKGROUND_COLUMNS)])
    for row in results:
        if "background_requests" in row["summary"]:
            lines.append(
                table_line([row["target"], row["level"], *formatted(row["summary"], BACKGROUND_COLUMNS)])
            )
    return "\n".join(lines) + "\n" if len(lines) > 2 else ""


SPECULATION_COLUMNS = [  # (header, key, scale, format)
    ("proposed", "spec_proposed", 1, "{:.0f}"),
    ("accepted", "spec_accepted", 1, "{:.0f}"),
    ("acceptance", "spec_acceptance", 100, "{:.0f}%"),
    ("out tokens", "output_tokens", 1, "{:.0f}"),
]


def speculation_table(results: list[dict]) -> str:
    """Speculative decoding's tokens proposed and accepted per (target, level) (medians over the
    runs), where the target reports them; "" if none does."""
    lines = table_header(["target", "level", *(c[0] for c in SPECULATION_COLUMNS)])
    for row in results:
        if row["summary"].get("spec_proposed") is not None:
            lines.append(
                table_line([row["target"], row["level"], *formatted(row["summary"], SPECULATION_COLUMNS)])
            )
    return "\n".join(lines) + "\n" if len(lines) > 2 else ""


HOSTILE_COLUMNS = [  # (header, key suffix, scale, format)
    ("requests", "requests", 1, "{:.0f}"),
    ("HTTP 200", "http_200", 1, "{:.0f}"),
    ("HTTP 413", "http_413", 1, "{:.0f}"),
    ("HTTP 429", "http_429", 1, "{:.0f}"),
    ("other HTTP", "http_other", 1, "{:.0f}"),
    ("no response", "no_response", 1, "{:.0f}"),
    ("unexpected", "unexpected", 1, "{:.0f}"),
    ("out tokens", "output_tokens", 1, "{:.0f}"),
    ("E2E p50 s", "latency_p50_s", 1, "{:.2f}"),
]


def hostile_kinds(summary: dict) -> list[str]:
    return [
        key[len("hostile_") : -len("_requests")]
        for key in summary
        if key.startswith("hostile_") and key.endswith("_requests") and key != "hostile_requests"
    ]


def hostile_table(results: list[dict]) -> str:
    """The hostile requests beside each (target, level), one row per kind (medians over the runs;
    unexpected: another status than the kind's expected one, 413 for huge_prompt, else 200); ""
    if there were none."""
    header = ["target", "level", "hostile kind", *(c[0] for c in HOSTILE_COLUMNS), "/health max s"]
    lines = table_header(header)
    for row in results:
        worst = row["summary"].get("hostile_health_max_s")  # absent from results of older benches
        health = ["-" if worst is None else f"{worst:.3f}"]
        for kind in hostile_kinds(row["summary"]):
            cells = formatted(row["summary"], HOSTILE_COLUMNS, f"hostile_{kind}_")
            lines.append(table_line([row["target"], row["level"], kind, *cells, *health]))
    return "\n".join(lines) + "\n" if len(lines) > 2 else ""


def plot(results: list[dict], path: Path) -> None:
    """Output tok/s, TTFT p50 and inter-token p50 against the load level, one line per target."""
    panels = [
        ("output tok/s", "output_tok_s", 1),
        ("TTFT p50 (ms)", "ttft_p50_s", 1000),
        ("inter-token p50 (ms)", "itl_p50_s", 1000),
    ]
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4))
    targets = list(dict.fromkeys(r["target"] for r in results))
    for ax, (title, key, scale) in zip(axes, panels):
        for target in targets:
            rows = [r for r in results if r["target"] == target and r["summary"][key] is not None]
            ax.plot(
                [r["x"] for r in rows], [r["summary"][key] * scale for r in rows], marker="o", label=target
            )
        ax.set_title(title)
        ax.set_xlabel(results[0]["x_label"])
        ax.grid(alpha=0.3)
        if results[0]["x_label"] == "concurrent streams":
            levels = sorted({r["x"] for r in results})
            ax.set_xscale("log", base=2)
            ax.set_xticks(levels, [f"{x:g}" for x in levels])
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write(results: list[dict], settings: dict, out_dir: Path, stem: str) -> dict[str, Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {kind: out_dir / f"{stem}.{kind}" for kind in ("json", "md", "png")}
    paths["json"].write_text(
        json.dumps({"settings": settings, "results": results}, indent=2, ensure_ascii=False)
    )
    background, hostile = background_table(results), hostile_table(results)
    speculated = speculation_table(results)
    paths["md"].write_text(
        f"Machine: {settings['machine']}\n\n"
        + markdown_table(results)
        + (f"\nSpeculative decoding:\n\n{speculated}" if speculated else "")
        + (f"\nLong prompts beside the runs:\n\n{background}" if background else "")
        + (f"\nHostile requests beside the runs:\n\n{hostile}" if hostile else "")
    )
    plot(results, paths["png"])
    return paths
