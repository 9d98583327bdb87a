"""tools.bench.pooling end to end against a stand-in server (a local HTTP server answering OpenAI's
embeddings and Jina's rerank shapes): the documents it sends are distinct, every workload is timed
and reported, and a server's error stops the run."""

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from tools.bench.pooling import documents, main


@pytest.fixture
def stand_in():
    seen: dict[str, list] = {"/v1/embeddings": [], "/v1/rerank": []}

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            seen[self.path].append(body)
            if self.path == "/v1/embeddings":
                reply = {"data": [{"embedding": [0.6, 0.8], "index": 0}]}
            else:
                results = [{"index": i, "relevance_score": 1 / (i + 1)} for i in range(body["top_n"])]
                reply = {"results": results}
            data = json.dumps(reply).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}", seen
    server.shutdown()


def test_documents_are_distinct_and_of_the_length_asked():
    docs = documents(20, 30, seed=0)
    assert len(set(docs)) == 20 and all(len(d.split()) == 30 for d in docs)
    assert len({d.split()[0] for d in docs}) > 1 and documents(20, 30, seed=0) == docs


def test_every_workload_is_timed_and_reported(stand_in, tmp_path):
    url, seen = stand_in
    args = [
        "--target",
        f"a={url}",
        "--vs",
        f"b={url}",
        "--docs",
        "12",
        "--doc-words",
        "10",
        "--concurrency",
        "4",
    ]
    args += ["--queries", "3", "--rerank-docs", "5", "--repeats", "2", "--model", "m", "--out", str(tmp_path)]
    assert main([*args, "--name", "run"]) == 0
    report = json.loads((tmp_path / "run.json").read_text())
    assert [r["target"] for r in report["results"]] == ["a", "b"]
    assert all(r["embed"] > 0 and r["query_p50"] > 0 and r["rerank"] > 0 for r in report["results"])
    # warm-up 8 a target, then 12 documents and 3 queries a run; every request names the model
    assert len(seen["/v1/embeddings"]) == 2 * 8 + 2 * 2 * (12 + 3)
    assert all(body["model"] == "m" for body in seen["/v1/embeddings"])
    assert [len(body["documents"]) for body in seen["/v1/rerank"]] == [8, 8, 5, 5, 5, 5]  # warm-ups first
    first, second = (seen["/v1/rerank"][i]["documents"] for i in (2, 4))
    assert first != second  # a run's inputs are new: no prefix-cache hit
    assert "| a |" in (tmp_path / "run.md").read_text()
