"""The benchmark tool's parts on synthetic input: stream parsing of both APIs, target URLs,
statistics, and the files it writes. A real run against a server is in test_http_api.py."""

import itertools
import json

import pytest

from tools.bench import report
from tools.bench.__main__ import parse_args, request_bodies
from tools.bench.stats import RequestRecord, median_of_runs, percentile, summarize
from tools.bench.targets import Target, TargetError, parse_line

pytestmark = pytest.mark.unit


def test_native_stream_lines():
    assert parse_line("native", 'data:{"token": {"text": "Hi", "index": 0}}').text == "Hi"
    assert parse_line("native", 'data:{"generated_text": "Hi there"}').done
    assert (
        parse_line("native", 'data:{"error": "the server is shutting down"}').error
        == "the server is shutting down"
    )
    assert parse_line("native", "") is None


def test_openai_stream_lines():
    chunk = {"choices": [{"index": 0, "delta": {"content": " Paris"}, "finish_reason": None}]}
    assert parse_line("chat", "data: " + json.dumps(chunk)).text == " Paris"
    assert parse_line("completions", 'data: {"choices": [{"text": "ab"}]}').text == "ab"
    usage = parse_line("completions", 'data: {"choices": [], "usage": {"completion_tokens": 7}}')
    assert usage.tokens == 7 and usage.text == ""
    assert parse_line("chat", "data: [DONE]").done
    assert parse_line("chat", ": keep-alive comment") is None
    assert parse_line("chat", 'data: {"error": {"message": "bad", "type": "x"}}').error == "bad"


def test_target_urls():
    native = Target.parse("ours=http://127.0.0.1:9811/models/smollm2/generate_stream")
    assert (native.label, native.url, native.api) == (
        "ours",
        "http://127.0.0.1:9811/models/smollm2",
        "native",
    )
    chat = Target.parse("http://localhost:8080/v1/chat/completions")
    assert (chat.label, chat.api) == ("localhost:8080", "chat")
    assert Target.parse("http://h:1/v1/completions").api == "completions"
    for bad in ("localhost:8080/v1/completions", "http://h:1/generate", "ftp://h/models/x"):
        with pytest.raises(TargetError):
            Target.parse(bad)
    body = chat.request_body("hello", 16, True, "m")
    assert body["messages"] == [{"role": "user", "content": "hello"}] and body["max_tokens"] == 16
    assert body["model"] == "m" and body["ignore_eos"] and body["temperature"] == 0
    assert native.request_body("hello", 16, False, None)["parameters"]["max_new_tokens"] == 16


def test_cli_needs_a_target_and_unique_labels():
    with pytest.raises(SystemExit):
        parse_args([])
    with pytest.raises(SystemExit):
        parse_args(["--target", "http://h:1/models/a", "--vs", "http://h:1/models/b"])
    args = parse_args(
        [
            "--target",
            "http://h:1/models/a",
            "--vs",
            "b=http://h:2/v1/completions",
            "--concurrency",
            "1,4",
            "--output-len",
            "16:32",
        ]
    )
    assert [t.label for t in args.targets] == ["h:1", "b"] and args.concurrency == [1, 4]
    assert args.output_len == (16, 32)


def sorted_rank_percentile(values, q):
    """Independent reference: linear interpolation between closest ranks, by hand."""
    ordered = sorted(values)
    rank = q / 100 * (len(ordered) - 1)
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


@pytest.mark.parametrize("values", [[5.0], [3.0, 1.0], list(range(1, 101)), [0.2, 9.5, 0.1, 4.4, 4.4, 7.0]])
@pytest.mark.parametrize("q", [0, 50, 90, 99, 100])
def test_percentile_matches_a_hand_computation(values, q):
    assert percentile(values, q) == pytest.approx(sorted_rank_percentile(values, q))
    assert percentile([], q) is None


def test_summary_of_synthetic_requests():
    def record(start, times, tokens=None):
        return RequestRecord(
            start=start,
            first_token=times[0],
            end=times[-1] + 0.5,
            token_times=times,
            tokens=tokens or len(times),
        )

    records = [
        record(0.0, [1.0, 1.1, 1.3]),
        record(0.0, [2.0, 2.2], tokens=5),
        RequestRecord(start=0.0, end=0.1, error="HTTP 503: full"),
    ]
    summary = summarize(records, wall_s=4.0)
    assert summary["requests"] == 3 and summary["errors"] == 1
    assert summary["error_messages"] == ["HTTP 503: full"]
    assert summary["output_tokens"] == 8 and summary["output_tok_s"] == 2.0
    assert summary["requests_per_s"] == 0.5
    assert summary["ttft_p50_s"] == pytest.approx(1.5)  # TTFTs 1.0 and 2.0
    assert summary["itl_p50_s"] == pytest.approx(0.2)  # gaps 0.1, 0.2, 0.2
    assert summary["latency_p50_s"] == pytest.approx(2.25)  # 1.8 and 2.7
    runs = [summary, {**summary, "output_tok_s": 4.0}, {**summary, "output_tok_s": 3.0}]
    assert median_of_runs(runs)["output_tok_s"] == 3.0 and median_of_runs(runs)["runs"] == 3


def test_report_files(tmp_path):
    summary = summarize(
        [RequestRecord(start=0, first_token=0.5, end=1.0, token_times=[0.5, 0.6], tokens=2)], 1.0
    )
    results = [
        {
            "target": t,
            "level": n,
            "x": n,
            "x_label": "concurrent streams",
            "summary": summary,
            "runs": [summary],
        }
        for t in ("a", "b")
        for n in (1, 2)
    ]
    paths = report.write(results, {"seed": 0}, tmp_path / "bench", "run")
    assert json.loads(paths["json"].read_text())["results"][0]["summary"]["output_tokens"] == 2
    table = paths["md"].read_text().splitlines()
    assert len(table) == 2 + 4 and table[2].startswith("| a | 1 | 500 |")
    assert paths["png"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_every_target_gets_the_same_numbered_prompts():
    """Numbered prompts: no server can answer a request from the cache of an identical earlier one,
    and every target still gets the same sequence of bodies."""
    args = parse_args(["--target", "http://h:1/models/a", "--vs", "b=http://h:2/v1/completions"])
    native, openai = args.targets
    prompts = ["hello", "world"]
    first = [b["inputs"] for b in itertools.islice(request_bodies(native, args, prompts, None, "r1"), 5)]
    again = [b["prompt"] for b in itertools.islice(request_bodies(openai, args, prompts, "m", "r1"), 5)]
    assert first == again and len(set(first)) == 5
    assert first[0].startswith("[r1.0] ") and {p.split("] ", 1)[1] for p in first[:2]} == set(prompts)
    other_run = [b["inputs"] for b in itertools.islice(request_bodies(native, args, prompts, None, "r2"), 5)]
    assert not set(other_run) & set(first)
    plain = parse_args(["--target", "http://h:1/models/a", "--no-unique-prompts"])
    texts = [b["inputs"] for b in itertools.islice(request_bodies(plain.targets[0], plain, prompts, None), 4)]
    assert set(texts) == set(prompts)
