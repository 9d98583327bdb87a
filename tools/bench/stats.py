"""Per-request timings and the statistics of a run."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass
class RequestRecord:
    start: float  # monotonic seconds
    first_token: float | None = None
    end: float | None = None
    token_times: list[float] = field(default_factory=list)  # arrival of each event that carried a token
    tokens: int = 0  # output tokens: the server's count if it gave one, else token events received
    error: str | None = None
    status: int | None = None  # the HTTP status; None when no response came (a connection error)
    text: str = ""  # the answer (a multi-turn chat's next prompt holds it)
    turn: int = 0  # its turn in a multi-turn chat (0: the first)
    drafted: int | None = None  # speculative decoding, where the server reports it per request
    accepted: int | None = None

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.start

    @property
    def latency(self) -> float | None:
        return None if self.end is None else self.end - self.start

    @property
    def inter_token(self) -> list[float]:
        return [b - a for a, b in zip(self.token_times, self.token_times[1:])]


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile (0-100), linear interpolation between closest ranks; None if empty."""
    return float(np.percentile(values, q)) if values else None


def summarize(records: list[RequestRecord], wall_s: float) -> dict:
    ok = [r for r in records if r.error is None]
    ttft = [r.ttft for r in ok if r.ttft is not None]
    itl = [gap for r in ok for gap in r.inter_token]
    latency = [r.latency for r in ok if r.latency is not None]
    tokens = sum(r.tokens for r in ok)
    reported = [r for r in ok if r.drafted is not None]  # per-request speculation counts (llama.cpp)
    return {
        "requests": len(records),
        "errors": len(records) - len(ok),
        "error_messages": sorted({r.error for r in records if r.error})[:5],
        "wall_s": wall_s,
        "output_tokens": tokens,
        "output_tok_s": tokens / wall_s if wall_s > 0 else 0.0,
        "requests_per_s": len(ok) / wall_s if wall_s > 0 else 0.0,
        "ttft_p50_s": percentile(ttft, 50),
        "ttft_p90_s": percentile(ttft, 90),
        "ttft_p99_s": percentile(ttft, 99),
        "itl_p50_s": percentile(itl, 50),
        "itl_p99_s": percentile(itl, 99),
        "latency_p50_s": percentile(latency, 50),
        "latency_p90_s": percentile(latency, 90),
        "latency_p99_s": percentile(latency, 99),
        **prefix_split(ok),
        **speculation(
            sum(r.drafted or 0 for r in reported) if reported else None,
            sum(r.accepted or 0 for r in reported),
        ),
    }


def speculation(proposed: float | None, accepted: float) -> dict:
    """Speculative decoding's tokens proposed and accepted in a run, and their ratio (None where the
    server reports none)."""
    return {
        "spec_proposed": proposed,
        "spec_accepted": None if proposed is None else accepted,
        "spec_acceptance": accepted / proposed if proposed else None,
    }


def prefix_split(ok: list[RequestRecord]) -> dict:
    """TTFT of the first request against the rest (shared-prefix traffic: the first computes the
    prefix, the rest may find it cached) and of first turns against later ones (multi-turn chats:
    a later turn's prompt is the earlier turns and their answers)."""
    timed = sorted(((r.start, r.ttft, r.turn) for r in ok if r.ttft is not None), key=lambda t: t[0])
    return {
        "ttft_first_s": timed[0][1] if timed else None,
        "ttft_rest_p50_s": percentile([ttft for _, ttft, _ in timed[1:]], 50),
        "ttft_first_turn_p50_s": percentile([ttft for _, ttft, turn in timed if turn == 0], 50),
        "ttft_later_turns_p50_s": percentile([ttft for _, ttft, turn in timed if turn > 0], 50),
    }


def median_of_runs(runs: list[dict]) -> dict:
    """Each numeric metric's median over repeated runs of the same level (noise on a shared box)."""
    out: dict[str, Any] = {}
    for key in runs[0]:
        values = [r[key] for r in runs if r[key] is not None]
        if values and all(isinstance(v, list) for v in values):
            out[key] = sorted({v for value in values for v in value})[:5]
        elif values:
            out[key] = statistics.median(values)
        else:
            out[key] = None
    out["runs"] = len(runs)
    return out


def is_unexpected(expect: int, record: RequestRecord) -> bool:
    """Another status than `expect`, or an error inside a 200 stream (a 413's error is its answer)."""
    return record.status != expect or (record.status == 200 and record.error is not None)


def summarize_hostile(
    outcomes: Sequence[tuple[str, int, RequestRecord]], kinds: Sequence[str], health: Sequence[float] = ()
) -> dict:
    """The hostile requests beside a run, (kind, expected status, record) each -> flat counts by kind
    and status (`hostile_KIND_http_200`, `_http_413`, `_http_429`, `_http_other`, `_no_response`),
    `_unexpected` (another status than the kind's expected one, or an error inside a 200 stream),
    output tokens and median latency; every kind has every key, so repeated runs line up for
    median_of_runs(). `health`: the latencies of /health polled meanwhile (their largest)."""
    out: dict[str, Any] = {
        "hostile_requests": len(outcomes),
        "hostile_health_max_s": max(health, default=None),
    }
    unexpected_total = 0
    for kind in kinds:
        mine = [(expect, r) for k, expect, r in outcomes if k == kind]
        unexpected = sum(1 for expect, r in mine if is_unexpected(expect, r))
        unexpected_total += unexpected
        latency = [r.latency for _, r in mine if r.latency is not None]
        out.update(
            {
                f"hostile_{kind}_requests": len(mine),
                f"hostile_{kind}_http_200": sum(1 for _, r in mine if r.status == 200),
                f"hostile_{kind}_http_413": sum(1 for _, r in mine if r.status == 413),
                f"hostile_{kind}_http_429": sum(1 for _, r in mine if r.status == 429),
                f"hostile_{kind}_http_other": sum(
                    1 for _, r in mine if r.status not in (None, 200, 413, 429)
                ),
                f"hostile_{kind}_no_response": sum(1 for _, r in mine if r.status is None),
                f"hostile_{kind}_unexpected": unexpected,
                f"hostile_{kind}_output_tokens": sum(r.tokens for _, r in mine if r.error is None),
                f"hostile_{kind}_latency_p50_s": percentile(latency, 50),
            }
        )
    out["hostile_unexpected"] = unexpected_total
    out["hostile_error_messages"] = sorted(
        {f"{k}: {r.error}" for k, expect, r in outcomes if r.error and is_unexpected(expect, r)}
    )[:5]
    return out
