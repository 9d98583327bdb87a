"""Start llama.cpp's own server (the PyPI wheel `xllamacpp`) on the same GGUF, for side-by-side
benchmarks with `python -m tools.bench --vs http://127.0.0.1:8080/v1/completions`.

xllamacpp is not a dependency of this project; install it in a separate environment:

    python3 -m venv /tmp/xllamacpp && /tmp/xllamacpp/bin/pip install xllamacpp
    /tmp/xllamacpp/bin/python tools/llamacpp_server.py --parallel 16 --threads 2

It serves until Ctrl-C or SIGTERM (OpenAI API: /v1/completions, /v1/chat/completions, /v1/models).
"""

import argparse
import signal
import sys
import threading
from pathlib import Path

SPECULATION = {  # --spec: xllamacpp's common_speculative_type
    "none": "COMMON_SPECULATIVE_TYPE_NONE",
    "ngram-simple": "COMMON_SPECULATIVE_TYPE_NGRAM_SIMPLE",
    "ngram-map-k": "COMMON_SPECULATIVE_TYPE_NGRAM_MAP_K",
    "ngram-mod": "COMMON_SPECULATIVE_TYPE_NGRAM_MOD",
}
DEFAULT_MODEL = Path(__file__).resolve().parent.parent / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model", type=Path, default=DEFAULT_MODEL, help="GGUF file (default: the embedded model)"
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8080)
    parser.add_argument("--parallel", type=int, default=16, help="slots (concurrent sequences)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--ctx", type=int, default=16 * 2048, help="total context, shared by the slots")
    parser.add_argument(
        "--spec",
        choices=sorted(SPECULATION),
        default="none",
        help="speculative decoding: ngram-simple (prompt lookup, llama-server --spec-type ngram-simple), "
        "ngram-map-k, ngram-mod, or none",
    )
    parser.add_argument(
        "--spec-ngram-n", type=int, default=None, help="the n-gram length looked up (llama.cpp's default: 12)"
    )
    parser.add_argument(
        "--spec-ngram-m",
        type=int,
        default=None,
        help="the tokens drafted after a match (llama.cpp's default: 48)",
    )
    args = parser.parse_args()
    try:
        import xllamacpp
    except ImportError:
        print(
            "error: xllamacpp is not installed in this python; see this script's docstring", file=sys.stderr
        )
        return 2
    if not args.model.is_file():
        print(f"error: {args.model} not found (run `make setup` for the embedded model)", file=sys.stderr)
        return 2
    params = xllamacpp.CommonParams()
    params.model.path = str(args.model)
    params.n_parallel = args.parallel
    params.n_ctx = args.ctx
    params.cont_batching = True
    params.hostnames = [args.host]
    params.port = args.port
    params.cpuparams.n_threads = args.threads
    params.cpuparams_batch.n_threads = args.threads
    if args.spec != "none":
        kind = getattr(xllamacpp.common_speculative_type, SPECULATION[args.spec])
        params.speculative.types = [kind]
        for ngram in (params.speculative.ngram_simple, params.speculative.ngram_map_k):
            if args.spec_ngram_n:
                ngram.size_n = args.spec_ngram_n
            if args.spec_ngram_m:
                ngram.size_m = args.spec_ngram_m
    server = xllamacpp.Server(params)
    print(
        f"llama.cpp server (xllamacpp) on http://{args.host}:{args.port}/v1 "
        f"({args.parallel} slots, {args.threads} threads, speculation {args.spec})",
        flush=True,
    )
    stop = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: stop.set())
    stop.wait()
    del server
    return 0


if __name__ == "__main__":
    sys.exit(main())
