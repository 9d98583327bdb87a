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
    server = xllamacpp.Server(params)
    print(
        f"llama.cpp server (xllamacpp) on http://{args.host}:{args.port}/v1 "
        f"({args.parallel} slots, {args.threads} threads)",
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
