"""python -m tools.bench.pooling --target NAME=URL [--vs NAME=URL ...] [--vs sentence-transformers=SHAPE]

The pooling workloads of a RAG deployment, side by side on the same machine: an embedding job
(--docs documents of about --doc-words words, each its own request, sent by --concurrency clients
back to back: documents per second), single short queries one at a time (latency p50), and a rerank
of --rerank-docs documents against one query in one request (documents per second). A URL is a
server's root: OpenAI's /v1/embeddings and Jina's /v1/rerank, which this server and llama.cpp's
`llama-server --embedding` / `--reranking` both serve (--model names the model where a server holds
several). `sentence-transformers=SHAPE` runs sentence-transformers in this process on PyTorch's CPU
build (what most RAG code runs): a model of that shape (tools.make_gguf's preset) with random
weights and the same vocabulary, encoding the same documents in batches of --concurrency. Targets
alternate run by run; each figure is the median of --repeats runs. Documents are distinct from
their first word (no prefix-cache hits). Results go to output/bench/<name>.{json,md}.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from tools.bench.__main__ import machine
from tools.bench.options import WORKLOADS
from tools.bench.report import table_header, table_line

ST_PREFIX = "sentence-transformers="
QUERY = "Which document explains how the city kept its water clean?"


def words() -> list[str]:
    """The benchmark's own prompt texts as a pool of words."""
    lines = WORKLOADS["normal"].read_text().splitlines()
    return [w for line in lines for w in json.loads(line)["prompt"].split()]


def documents(count: int, length: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    pool = words()
    return [" ".join(rng.choices(pool, k=length)) for _ in range(count)]


class Server:
    """A server over HTTP: embeddings and rerank."""

    def __init__(self, label: str, url: str, model: str | None):
        self.label, self.url, self.model = label, url.rstrip("/"), model

    def body(self, **fields) -> dict:
        return {**fields, **({"model": self.model} if self.model else {})}

    async def embed_job(self, docs: list[str], concurrency: int) -> float:
        """Every document embedded, `concurrency` requests in flight: documents per second."""
        todo = iter(docs)
        async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=concurrency)) as client:

            async def worker() -> None:
                for doc in todo:
                    reply = await client.post(f"{self.url}/v1/embeddings", json=self.body(input=doc))
                    reply.raise_for_status()
                    assert len(reply.json()["data"][0]["embedding"]) > 0

            start = time.perf_counter()
            await asyncio.gather(*(worker() for _ in range(concurrency)))
            return len(docs) / (time.perf_counter() - start)

    def query_latencies(self, queries: list[str]) -> list[float]:
        times = []
        with httpx.Client(timeout=120) as client:
            for query in queries:
                start = time.perf_counter()
                client.post(f"{self.url}/v1/embeddings", json=self.body(input=query)).raise_for_status()
                times.append(time.perf_counter() - start)
        return times

    def rerank(self, docs: list[str]) -> float:
        """One query against every document in one request: documents per second."""
        start = time.perf_counter()
        reply = httpx.post(
            f"{self.url}/v1/rerank", json=self.body(query=QUERY, documents=docs, top_n=3), timeout=600
        )
        reply.raise_for_status()
        assert len(reply.json()["results"]) == 3
        return len(docs) / (time.perf_counter() - start)


class InProcess:
    """sentence-transformers in this process: a random model of a tools.make_gguf shape."""

    def __init__(self, label: str, shape_name: str, tokenizer: Path):
        import tempfile

        import torch
        import transformers
        from sentence_transformers import SentenceTransformer
        from sentence_transformers.sentence_transformer.modules import Dense, Normalize, Pooling, Transformer

        from agent.model.tokenizer import load_tokenizer
        from tools.make_gguf import SHAPES

        shape = SHAPES[shape_name]
        self.label = label
        directory = Path(tempfile.mkdtemp(prefix="st-bench-"))
        text_tokenizer = load_tokenizer(tokenizer)
        text_tokenizer.save(directory)
        common: dict[str, Any] = {
            "vocab_size": text_tokenizer.vocab_size,
            "hidden_size": shape.hidden,
            "intermediate_size": shape.ffn,
            "num_hidden_layers": shape.layers,
            "num_attention_heads": shape.heads,
            "num_key_value_heads": shape.kv_heads,
            "head_dim": shape.hd,
            "tie_word_embeddings": True,
        }
        config: transformers.PretrainedConfig
        model: transformers.PreTrainedModel
        if shape.dense:  # EmbeddingGemma: Gemma 3's layers both ways, mean pooling, two projections
            config = transformers.Gemma3TextConfig(
                **common,
                sliding_window=shape.window,
                query_pre_attn_scalar=shape.hd,
                max_position_embeddings=shape.context,
                use_bidirectional_attention=True,
            )
            model = transformers.Gemma3TextModel(config)
            head = [
                Pooling(shape.hidden, pooling_mode="mean"),
                Dense(shape.hidden, shape.dense, bias=False, activation_function=torch.nn.Identity()),
                Dense(shape.dense, shape.hidden, bias=False, activation_function=torch.nn.Identity()),
            ]
        else:  # Qwen3-Embedding: last-token pooling
            config = transformers.Qwen3Config(**common)
            model = transformers.Qwen3Model(config)
            head = [Pooling(shape.hidden, pooling_mode="lasttoken")]
        model.save_pretrained(directory)  # float32
        config.save_pretrained(directory)
        transformer = Transformer(str(directory))
        self.model = SentenceTransformer(modules=[transformer, *head, Normalize()], device="cpu")
        self.threads = torch.get_num_threads()

    def embed_job(self, docs: list[str], batch: int) -> float:
        start = time.perf_counter()
        self.model.encode(docs, batch_size=batch)
        return len(docs) / (time.perf_counter() - start)

    def query_latencies(self, queries: list[str]) -> list[float]:
        times = []
        for query in queries:
            start = time.perf_counter()
            self.model.encode([query])
            times.append(time.perf_counter() - start)
        return times


def parse_args(argv) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", action="append", required=True, help="NAME=URL (a server's root)")
    parser.add_argument("--vs", action="append", default=[], help="NAME=URL, or sentence-transformers=SHAPE")
    parser.add_argument("--model", help="the model a server holding several serves the requests with")
    parser.add_argument("--tokenizer", type=Path, default=Path("models/llama-vocab/ggml-vocab-qwen2.gguf"))
    parser.add_argument("--docs", type=int, default=1000)
    parser.add_argument("--doc-words", type=int, default=190, help="~256 tokens of Qwen3's vocabulary")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--queries", type=int, default=20)
    parser.add_argument("--rerank-docs", type=int, default=100)
    parser.add_argument("--skip", default="", help="workloads to leave out: embed, query, rerank")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--name", default=time.strftime("pooling-%Y%m%d-%H%M%S"))
    parser.add_argument("--out", type=Path, default=Path("output/bench"))
    return parser.parse_args(argv)


def targets(args) -> list[Server | InProcess]:
    made: list[Server | InProcess] = []
    for given in [*args.target, *args.vs]:
        label, _, where = given.partition("=")
        if given.startswith(ST_PREFIX):
            made.append(InProcess(label, where, args.tokenizer))
        else:
            made.append(Server(label, where, args.model))
    return made


def run_once(target: Server | InProcess, args, workloads: dict, repeat: int, seen: dict) -> None:
    """One run of each workload on `target` (its inputs made new each repeat: no hit on an earlier
    run's prefix cache)."""
    skip = set(args.skip.split(","))
    if "embed" not in skip:
        job = workloads["docs"] if repeat == 0 else [f"{d} {repeat}" for d in workloads["docs"]]
        if isinstance(target, Server):
            seen["embed"].append(asyncio.run(target.embed_job(job, args.concurrency)))
        else:
            seen["embed"].append(target.embed_job(job, args.concurrency))
    if "query" not in skip:
        latencies = target.query_latencies([f"{q} {repeat}" for q in workloads["queries"]])
        seen["query_p50"].append(statistics.median(latencies))
    if "rerank" not in skip and isinstance(target, Server):
        seen["rerank"].append(target.rerank([f"{d} {repeat}" for d in workloads["rerank"]]))


def table(rows: list[dict], args, machine_name: str) -> list[str]:
    def cell(value, scale: float = 1.0) -> str:
        return "-" if value is None else f"{value * scale:.3g}"

    return [
        f"Machine: {machine_name}",
        "",
        "; ".join(
            part
            for name, part in (
                ("embed", f"{args.docs} documents of ~{args.doc_words} words by {args.concurrency} clients"),
                ("query", "single queries of 8 words"),
                ("rerank", f"rerank of {args.rerank_docs} documents"),
            )
            if name not in args.skip.split(",")
        )
        + f"; medians of {args.repeats}",
        "",
        *table_header(["target", "embed docs/s", "query p50 ms", "rerank docs/s"]),
        *(
            table_line([r["target"], cell(r["embed"]), cell(r["query_p50"], 1000), cell(r["rerank"])])
            for r in rows
        ),
    ]


def main(argv=None) -> int:
    args = parse_args(argv)
    workloads = {
        "docs": documents(args.docs, args.doc_words, seed=0),
        "queries": documents(args.queries, 8, seed=1),
        "rerank": documents(args.rerank_docs, args.doc_words, seed=2),
    }
    chosen = targets(args)
    runs: dict[str, dict[str, list]] = {t.label: {"embed": [], "query_p50": [], "rerank": []} for t in chosen}
    skip = set(args.skip.split(","))
    for target in chosen:  # warm-up: compile and first-touch, not timed
        if isinstance(target, InProcess):
            target.embed_job(workloads["docs"][:8], 4)
        elif not {"embed", "query"} <= skip:
            asyncio.run(target.embed_job(workloads["docs"][:8], 4))
        if isinstance(target, Server) and "rerank" not in skip:
            target.rerank(workloads["docs"][:8])
    for repeat, target in itertools.product(range(args.repeats), chosen):
        seen = runs[target.label]
        run_once(target, args, workloads, repeat, seen)
        done = ", ".join(f"{k} {v[-1]:.3g}" for k, v in seen.items() if v)
        print(f"run {repeat + 1}/{args.repeats} {target.label}: {done}")
    rows = [
        {"target": label, **{k: statistics.median(v) if v else None for k, v in seen.items()}}
        for label, seen in runs.items()
    ]
    settings = {"machine": machine(), **{k: str(v) for k, v in vars(args).items()}}
    lines = table(rows, args, settings["machine"])
    args.out.mkdir(parents=True, exist_ok=True)
    report = {"settings": settings, "results": rows, "runs": runs}
    (args.out / f"{args.name}.json").write_text(json.dumps(report, indent=1))
    (args.out / f"{args.name}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
