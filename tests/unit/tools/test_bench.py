"""The benchmark tool's parts on synthetic input: stream parsing of both APIs, target URLs,
statistics, and the files it writes; --hostile against a stand-in server in a thread. A real run
against a server is in test_http_api.py."""

import contextlib
import itertools
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from tools.bench import report
from tools.bench.__main__ import hostile_requests, main, request_bodies
from tools.bench.options import HUGE_PROMPT_BYTES, parse_args
from tools.bench.stats import RequestRecord, median_of_runs, percentile, summarize, summarize_hostile
from tools.bench.targets import Target, TargetError, parse_line


def test_native_stream_lines():
    assert parse_line("native", 'data:{"token": {"text": "Hi", "index": 0}}').text == "Hi"
    # a line per token: one whose token completes no text (part of a character) still counts
    empty = parse_line("native", 'data:{"token": {"text": "", "index": 1, "special": false}}')
    assert empty.token and empty.text == ""
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
    # vLLM's chunk for a token with no text of its own is a token; the role chunk and a last chunk
    # that only gives the finish reason are not
    empty = '{"choices": [{"text": "", "finish_reason": null}]}'
    assert parse_line("completions", "data: " + empty).token
    assert not parse_line("completions", 'data: {"choices": [{"text": "", "finish_reason": "length"}]}').token
    role = {"choices": [{"delta": {"role": "assistant", "content": ""}, "finish_reason": None}]}
    assert not parse_line("chat", "data: " + json.dumps(role)).token
    assert parse_line("chat", "data: " + json.dumps(chunk)).token
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


def test_speculation_counts_from_llamacpp_timings_and_the_speculation_table():
    """llama.cpp reports a request's drafted and accepted tokens in its last chunk's `timings`: a
    run sums them, the acceptance is their ratio; a server that reports none has no row."""
    last = {"choices": [], "timings": {"draft_n": 12, "draft_n_accepted": 9, "predicted_n": 30}}
    event = parse_line("chat", "data: " + json.dumps(last))
    assert (event.drafted, event.accepted) == (12, 9)
    records = [
        RequestRecord(start=0, first_token=0.1, end=1, tokens=30, drafted=12, accepted=9),
        RequestRecord(start=0, first_token=0.1, end=1, tokens=30, drafted=8, accepted=1),
    ]
    summary = summarize(records, 1.0)
    assert (summary["spec_proposed"], summary["spec_accepted"], summary["spec_acceptance"]) == (20, 10, 0.5)
    plain = summarize([RequestRecord(start=0, first_token=0.1, end=1, tokens=30)], 1.0)
    assert plain["spec_proposed"] is None and plain["spec_acceptance"] is None
    rows = [{"target": t, "level": 1, "summary": s} for t, s in (("spec", summary), ("plain", plain))]
    table = report.speculation_table(rows)
    assert "| spec | 1 | 20 | 10 | 50% | 60 |" in table and "plain" not in table
    assert report.speculation_table(rows[1:]) == ""


def test_the_copy_workload_names_its_prompt_file():
    args = parse_args(["--target", "http://h:1/models/m", "--workload", "copy"])
    assert args.prompts.name == "copy_prompts.jsonl"
    assert parse_args(["--target", "http://h:1/models/m"]).prompts.name == "prompts.jsonl"


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
    machine = "AMD EPYC (x86_64; AVX2); kernels: avx2 (AVX2)"
    paths = report.write(results, {"seed": 0, "machine": machine}, tmp_path / "bench", "run")
    assert json.loads(paths["json"].read_text())["results"][0]["summary"]["output_tokens"] == 2
    lines = paths["md"].read_text().splitlines()
    assert lines[:2] == [f"Machine: {machine}", ""]  # every table says which CPU made it
    table = lines[2:]
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


def test_hostile_requests_of_each_kind():
    args = parse_args(["--target", "http://h:1/models/a", "--vs", "b=http://h:2/v1/chat/completions"])
    assert args.hostile == 0 and args.hostile_kinds == ["stop_flood", "huge_prompt", "full_vocab"]
    native, chat = args.targets
    flood, huge, vocab, again = itertools.islice(hostile_requests(native, args, ["hi"], None, "r"), 4)
    assert [r.kind for r in (flood, huge, vocab, again)] == [*args.hostile_kinds, "stop_flood"]
    assert (flood.expect, huge.expect, vocab.expect) == (200, 413, 200)
    stops = flood.body["parameters"]["stop"]
    assert len(stops) == 4 and {len(s) for s in stops} == {256} and flood.body["inputs"] == "[r.h0] hi"
    assert flood.body["parameters"]["ignore_eos"] and flood.body["parameters"]["max_new_tokens"] == 256
    sampled = vocab.body["parameters"]
    assert sampled["do_sample"] and sampled["temperature"] == 1.0 and sampled["top_k"] == 0
    assert sampled["top_p"] == 1.0 and "stop" not in sampled
    assert isinstance(huge.body, bytes) and len(json.loads(huge.body)["inputs"].encode()) == HUGE_PROMPT_BYTES
    chat_args = parse_args(
        ["--target", chat.url, "--hostile-kinds", "full_vocab,stop_flood", "--hostile-len", "9"]
    )
    sampled_chat, flood_chat = itertools.islice(hostile_requests(chat, chat_args, ["hi"], "m"), 2)
    assert sampled_chat.body["temperature"] == 1.0 and sampled_chat.body["top_k"] == 0
    assert len(flood_chat.body["stop"]) == 4 and flood_chat.body["temperature"] == 0.0
    assert flood_chat.body["max_tokens"] == 9 and flood_chat.body["messages"][0]["content"] == "[0.h1] hi"
    with pytest.raises(SystemExit):
        parse_args(["--target", "http://h:1/models/a", "--hostile-kinds", "stop_flood,nonsense"])


def test_hostile_summary_counts_by_kind_and_status():
    def record(status, error=None, tokens=0):
        return RequestRecord(start=0.0, end=1.0, status=status, error=error, tokens=tokens)

    outcomes = [
        ("huge_prompt", 413, record(413, "HTTP 413: too large")),
        ("huge_prompt", 413, record(None, "WriteError: reset")),
        ("stop_flood", 200, record(200, tokens=7)),
        ("stop_flood", 200, record(200, "the server is shutting down", tokens=3)),
    ]
    summary = summarize_hostile(outcomes, ["stop_flood", "huge_prompt", "full_vocab"])
    assert summary["hostile_requests"] == 4 and summary["hostile_unexpected"] == 2
    assert summary["hostile_huge_prompt_http_413"] == 1 and summary["hostile_huge_prompt_no_response"] == 1
    assert summary["hostile_stop_flood_http_200"] == 2 and summary["hostile_stop_flood_output_tokens"] == 7
    assert summary["hostile_full_vocab_requests"] == 0 and summary["hostile_full_vocab_latency_p50_s"] is None
    assert summary["hostile_error_messages"] == [
        "huge_prompt: WriteError: reset",
        "stop_flood: the server is shutting down",
    ]
    median = median_of_runs([summary, summary])
    assert median["hostile_stop_flood_http_200"] == 2 and median["hostile_full_vocab_latency_p50_s"] is None


@contextlib.contextmanager
def stand_in_server():
    """A native-API stand-in in a thread: each answer streams max_new_tokens pieces, 2 ms apart; a
    body over 1 MiB is 413; GET /health answers. Yields its base URL and the JSON bodies it
    answered (with the Authorization header each came with, as `_auth`)."""
    seen: list[dict] = []

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def do_GET(self):
            self.send_response(200 if self.path == "/health" else 404)
            self.end_headers()

        def do_POST(self):
            raw = self.rfile.read(int(self.headers["Content-Length"]))
            if len(raw) > HUGE_PROMPT_BYTES:
                self.send_response(413)
                self.end_headers()
                self.wfile.write(b'{"error": "the request body is too large"}')
                return
            body = json.loads(raw)
            seen.append({**body, "_auth": self.headers.get("Authorization")})
            self.send_response(200)
            self.send_header("Content-Type", "text/plain")
            self.end_headers()
            for i in range(body["parameters"]["max_new_tokens"]):
                time.sleep(0.002)  # the fake server's decode: a token every 2 ms
                self.wfile.write(b'data:{"token": {"text": "a", "index": %d}}\n' % i)
                self.wfile.flush()
            self.wfile.write(b'data:{"generated_text": "aaaa"}\n')

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", seen
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def test_hostile_clients_run_beside_the_timed_streams_and_are_reported_apart(tmp_path):
    with stand_in_server() as (base, seen):
        code = main(
            [
                "--target",
                f"fake={base}/models/m",
                "--concurrency",
                "1",
                "--requests",
                "3",
                "--output-len",
                "4",
                "--settle",
                "0",
                "--warmup",
                "0",
                "--hostile",
                "3",
                "--hostile-len",
                "6",
                "--api-key",
                "timed-key",
                "--hostile-api-key",
                "hostile-key",
                "--out",
                str(tmp_path),
                "--name",
                "run",
            ]
        )
    assert code == 0
    [result] = json.loads((tmp_path / "run.json").read_text())["results"]
    s = result["summary"]
    # The timed stream's metrics are its own: 3 requests of 4 tokens, whatever ran beside them.
    assert s["requests"] == 3 and s["errors"] == 0 and s["output_tokens"] == 12
    for kind in ("stop_flood", "huge_prompt", "full_vocab"):
        assert s[f"hostile_{kind}_requests"] >= 1
    assert s["hostile_huge_prompt_http_413"] == s["hostile_huge_prompt_requests"]
    assert s["hostile_stop_flood_http_200"] == s["hostile_stop_flood_requests"]
    assert s["hostile_unexpected"] == 0 and s["hostile_stop_flood_output_tokens"] >= 6
    assert s["hostile_huge_prompt_latency_p50_s"] > 0  # a refusal's turnaround is timed too
    timed = [b for b in seen if b["parameters"]["max_new_tokens"] == 4]
    assert len(timed) == 3 and not any(
        "stop" in b["parameters"] or "do_sample" in b["parameters"] for b in timed
    )
    # Each side its own key (fairness between clients is measured so); no key in the results.
    assert {b["_auth"] for b in timed} == {"Bearer timed-key"}
    assert {b["_auth"] for b in seen if b not in timed} == {"Bearer hostile-key"}
    assert "-key" not in (tmp_path / "run.json").read_text()
    assert 0 < s["hostile_health_max_s"] < 5  # /health polled beside the hostile clients
    assert any(len(b["parameters"].get("stop", [])) == 4 for b in seen)
    assert any(b["parameters"].get("do_sample") for b in seen)
    md = (tmp_path / "run.md").read_text()
    assert "Hostile requests" in md and "| fake | 1 | huge_prompt |" in md


def test_long_and_shared_prefix_prompts():
    """--prompt-words: each prompt that many words, each starting elsewhere; --shared-prefix-words:
    one system text of that many words starts every prompt of a run (numbered after it), another
    run's differs."""
    prompts = ["alpha beta gamma delta", "epsilon zeta eta theta iota"]
    args = parse_args(["--target", "http://h:1/models/a", "--prompt-words", "50"])
    bodies = [
        b["inputs"] for b in itertools.islice(request_bodies(args.targets[0], args, prompts, None, "r"), 4)
    ]
    texts = [b.split("] ", 1)[1] for b in bodies]
    assert all(len(t.split()) == 50 for t in texts) and len({t.split()[0] for t in texts}) > 1
    shared = parse_args(["--target", "http://h:1/models/a", "--shared-prefix-words", "30"])
    first, second = (
        [
            b["inputs"]
            for b in itertools.islice(request_bodies(shared.targets[0], shared, prompts, None, run), 3)
        ]
        for run in ("r1", "r2")
    )
    head = first[0].split("\n\n")[0]
    assert head.startswith("[r1] System: ") and len(head.split()) == 32  # tag, "System:", 30 words
    assert all(p.startswith(head + "\n\n[r1.") for p in first) and len(set(first)) == 3
    assert not second[0].startswith(head)


def test_multi_turn_chats_carry_the_answers_into_the_next_prompt(tmp_path):
    with stand_in_server() as (base, seen):
        args = ["--target", f"fake={base}/models/m", "--concurrency", "1", "--requests", "5"]
        args += [
            "--output-len",
            "3",
            "--settle",
            "0",
            "--warmup",
            "0",
            "--turns",
            "3",
            "--out",
            str(tmp_path),
            "--name",
            "chat",
        ]
        assert main(args) == 0
    prompts = [b["inputs"] for b in seen]
    assert len(prompts) == 5  # a chat of 3 turns, then 2 turns of the next
    for earlier, later in ((0, 1), (1, 2), (3, 4)):
        assert prompts[later].startswith(prompts[earlier] + "aaa\n\nUser: ")
    assert not prompts[3].startswith(prompts[2])
    [result] = json.loads((tmp_path / "chat.json").read_text())["results"]
    s = result["summary"]
    assert s["requests"] == 5 and s["ttft_first_turn_p50_s"] > 0 and s["ttft_later_turns_p50_s"] > 0


def test_extra_body_fields_go_to_their_targets():
    """--extra-body: side by side, the same server with and without (say) a grammar."""
    args = parse_args(
        [
            "--target",
            "plain=http://h:1/v1/completions",
            "--vs",
            "json=http://h:1/v1/completions",
            "--vs",
            "native=http://h:1/models/x",
            "--extra-body",
            '{"logprobs": 2}',
            "--extra-body",
            'json={"structured_outputs": {"regex": "[a-z]+"}}',
        ]
    )
    plain, constrained, native = (t.request_body("p", 4, True, "m") for t in args.targets)
    assert plain["logprobs"] == 2 and "structured_outputs" not in plain
    assert constrained["structured_outputs"] == {"regex": "[a-z]+"} and constrained["prompt"] == "p"
    assert native["parameters"]["logprobs"] == 2 and native["inputs"] == "p"
    assert "logprobs" not in Target.parse("http://h:1/v1/completions").request_body("p", 4, True, "m")
    with pytest.raises(SystemExit):
        parse_args(["--target", "http://h:1/v1/completions", "--extra-body", "[1]"])
