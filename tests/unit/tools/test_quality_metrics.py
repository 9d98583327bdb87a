"""tools.quality's arithmetic on hand-made distributions, checked against direct numpy computations;
its windows, text chunks and argument checks; a server without prompt logprobs (a stand-in in a
thread) ends it with a message and status 1. A run against a real server is in
tests/integration/tools/test_quality.py."""

import contextlib
import json
import math
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest

from tools.quality.__main__ import main, parse_args, windows
from tools.quality.client import chunks, read_positions
from tools.quality.metrics import Position, completed, kl_top_k, perplexity, summary, top1_agreement


def logprobs(probs: dict[str, float]) -> dict[str, float]:
    return {k: math.log(v) for k, v in probs.items()}


def test_perplexity_is_exp_of_mean_negative_logprob():
    values = [-0.5, -2.0, -1.25, -0.01]
    assert perplexity(values) == pytest.approx(np.exp(-np.mean(values)), rel=1e-12)
    assert perplexity([math.log(0.25)] * 7) == pytest.approx(4.0)  # uniform over 4: perplexity 4
    with pytest.raises(ValueError):
        perplexity([])


def test_kl_with_the_whole_vocabulary_is_the_exact_kl():
    rng = np.random.default_rng(0)
    p, q = rng.dirichlet(np.ones(8)), rng.dirichlet(np.ones(8))
    exact = float(np.sum(p * np.log(p / q)))
    as_dicts = [{str(i): float(np.log(v)) for i, v in enumerate(d)} for d in (p, q)]
    assert kl_top_k(*as_dicts) == pytest.approx(exact, rel=1e-9)
    assert kl_top_k(as_dicts[0], as_dicts[0]) == 0.0


def test_kl_over_the_top_k_completes_each_side_by_hand():
    # reference knows a, b (0.5, 0.3: 0.2 unreported); target knows a, c (0.6, 0.1: 0.3 unreported)
    reference, target = logprobs({"a": 0.5, "b": 0.3}), logprobs({"a": 0.6, "c": 0.1})
    # over [a, b, c, rest]: the reference's c gets min(0.2 / 2, 0.3) = 0.1, the rest 0.1; the
    # target's b gets min(0.3 / 2, 0.1) = 0.1 (below its least known), the rest 0.2
    p = np.array([0.5, 0.3, 0.1, 0.1])
    q = np.array([0.6, 0.1, 0.1, 0.2])
    assert completed(reference, ["a", "b", "c"]) == pytest.approx(p)
    assert completed(target, ["a", "b", "c"]) == pytest.approx(q)
    assert kl_top_k(reference, target) == pytest.approx(float(np.sum(p * np.log(p / q))), rel=1e-9)


def test_kl_over_the_same_top_k_is_a_coarsening_of_the_full_kl():
    # both sides' top 3 are the same ids (the target swaps the two best): the bucket merges the
    # tails, so the approximation is the exact KL where the tails agree and no more than it otherwise
    rng = np.random.default_rng(1)
    tails = [0.05 * rng.dirichlet(np.ones(50)) for _ in range(2)]

    def kls(reference_tail, target_tail):
        full = [
            np.concatenate([[0.6, 0.25, 0.1], reference_tail]),
            np.concatenate([[0.25, 0.6, 0.1], target_tail]),
        ]
        exact = float(np.sum(full[0] * np.log(full[0] / full[1])))
        top = [{str(i): float(np.log(d[i])) for i in range(3)} for d in full]
        return kl_top_k(top[0], top[1]), exact

    approximate, exact = kls(tails[0], tails[0])
    assert approximate == pytest.approx(exact, rel=1e-9) and exact > 0.3
    approximate, exact = kls(tails[0], tails[1])
    assert 0.8 * exact < approximate < exact


def test_top1_agreement_counts_positions_with_the_same_best_token():
    def at(best: str) -> Position:
        return Position(-1.0, {best: -0.1, "z": -3.0})

    reference = [at("a"), at("b"), at("c"), at("d")]
    target = [at("a"), at("x"), at("c"), at("y")]
    assert top1_agreement(reference, target) == 0.5
    assert top1_agreement(reference, reference) == 1.0
    with pytest.raises(ValueError):
        top1_agreement(reference, target[:3])
    result = summary(target, reference)
    assert result["top1_agreement"] == 0.5 and result["tokens_scored"] == 4
    assert result["perplexity"] == pytest.approx(math.e) and summary(target, None).keys() == {
        "tokens_scored",
        "perplexity",
    }


def test_windows_score_each_token_once_after_the_first():
    # back to back: each window's first token is context only
    assert windows(10, 4, 4, None) == [(0, 4, 1), (4, 8, 1), (8, 10, 1)]
    # overlapping: a later window scores only the tokens past the one before
    spans = windows(10, 4, 2, None)
    assert spans == [(0, 4, 1), (2, 6, 2), (4, 8, 2), (6, 10, 2)]
    scored = [s + i for s, e, first in spans for i in range(first, e - s)]
    assert scored == list(range(1, 10))
    assert windows(10, 4, 2, 2) == [(0, 4, 1), (2, 6, 2)]
    assert windows(9, 4, 4, None) == [(0, 4, 1), (4, 8, 1)]  # a last window of one token scores none
    assert windows(1, 4, 4, None) == []


def test_chunks_cut_between_paragraphs_and_rejoin():
    text = "one two.\n\nthree four five.\n\nsix\nseven eight nine ten eleven"
    pieces = chunks(text, 20)
    assert "".join(pieces) == text and all(len(p) <= 20 for p in pieces)
    assert pieces[0] == "one two.\n\n"
    assert "".join(chunks("x" * 45, 20)) == "x" * 45


def test_both_reply_shapes_are_read():
    vllm = {
        "prompt_logprobs": [
            None,
            {"7": {"logprob": -0.2, "rank": 1, "decoded_token": "a"}},
            {"9": {"logprob": -3.0, "rank": 4}, "5": {"logprob": -0.1, "rank": 1}},
        ]
    }
    first, second = read_positions(vllm, [1, 7, 9])[1:]
    assert first == Position(-0.2, {"7": -0.2})
    assert second is not None and second.logprob == -3.0 and second.best == "5"
    echo = {"logprobs": {"token_logprobs": [None, -0.7], "top_logprobs": [None, {" b": -0.3, " c": -2.0}]}}
    assert read_positions(echo, [1, 2]) == [None, Position(-0.7, {" b": -0.3, " c": -2.0})]


def test_bad_arguments_are_refused():
    for argv in (
        ["--window", "1"],
        ["--stride", "600"],
        ["--top-k", "0"],
        ["--top-k", "21"],
        ["--max-windows", "0"],
    ):
        with pytest.raises(SystemExit):
            parse_args(["--target", "http://127.0.0.1:1/v1", *argv])


@contextlib.contextmanager
def plain_server(answers: dict[str, dict]):
    """A server answering each path in `answers` with that JSON and any other with 404."""

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 (the http.server name)
            self.rfile.read(int(self.headers["Content-Length"]))
            answer = answers.get(self.path)
            self.send_response(200 if answer is not None else 404)
            self.end_headers()
            self.wfile.write(json.dumps(answer or {"error": "not found"}).encode())

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/v1"
    finally:
        server.shutdown()
        server.server_close()


def test_a_server_without_prompt_logprobs_ends_with_a_message(tmp_path, capsys):
    text = tmp_path / "text.txt"
    text.write_text("a short text")
    argv = ["--model", "m", "--text", str(text), "--out", str(tmp_path)]
    with plain_server({}) as url:  # no /tokenize
        assert main(["--target", url, *argv]) == 1
    assert "/tokenize" in capsys.readouterr().err
    # a completion without logprobs: the shape of a server that ignores echo
    tokens, plain = {"tokens": [1, 2, 3]}, {"choices": [{"text": "", "logprobs": None}]}
    with plain_server({"/tokenize": tokens, "/v1/completions": plain}) as url:
        assert main(["--target", url, *argv]) == 1
    assert "does not return prompt logprobs" in capsys.readouterr().err
    assert not list(tmp_path.glob("*.json"))
