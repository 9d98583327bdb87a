"""The GGUF writers of the family references (hf_reference, hf_moe_reference) checked against
llama.cpp: each tiny family model, written to GGUF as llama.cpp's converter would write it and served
by llama.cpp's own `llama-server`, gives the greedy answers transformers gives for the prompts the
suite uses (tests/integration/agent/test_transformers_reference.py and test_qwen3moe_reference.py
assert that this project's answers equal transformers'). Not a test: CI has no llama.cpp build.

    python tests/support/llamacpp_writer_check.py --llama-server /path/to/llama-server
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import urllib.request
from pathlib import Path

import hf_moe_reference as moe
import hf_reference as hf
from agent.model.tokenizer import load_tokenizer
from waiting import wait_until

NEW_TOKENS = 12
SUITE_TEXTS = (5, 20, 33)  # as the reference tests take them


def prompts(vocabulary_family: str) -> list[list[int]]:
    tokenizer = load_tokenizer(hf.vocabulary_path(vocabulary_family))
    texts = hf.suite_texts(vocabulary_family)
    long = tokenizer.encode(" ".join(texts))[:150]
    suite = [tokenizer.encode(texts[i]) for i in SUITE_TEXTS]
    return [tokenizer.encode("The capital of France is"), long, *suite]


def llamacpp_answers(server: Path, gguf: Path, cases: list[list[int]], port: int) -> list[list[int]]:
    """llama-server's greedy answers (token ids, no stop) for token-id prompts."""
    process = subprocess.Popen(
        [str(server), "-m", str(gguf), "--port", str(port), "-c", "1024", "-np", "1", "-t", "2"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        url = f"http://127.0.0.1:{port}"

        def healthy() -> bool:
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=1) as reply:
                    return reply.status == 200
            except OSError:  # not listening yet, or 503 while it loads the model
                return False

        wait_until(healthy, 120, "llama-server answering /health", poll_s=0.1)
        answers = []
        for prompt in cases:
            body = {
                "prompt": prompt,
                "n_predict": NEW_TOKENS,
                "temperature": 0.0,
                "top_k": 1,
                "ignore_eos": True,
                "cache_prompt": False,
                "return_tokens": True,
            }
            request = urllib.request.Request(
                f"{url}/completion", json.dumps(body).encode(), {"Content-Type": "application/json"}
            )
            with urllib.request.urlopen(request, timeout=120) as reply:
                answers.append(json.loads(reply.read())["tokens"])
        return answers
    finally:
        process.terminate()
        process.wait(30)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--llama-server", type=Path, required=True)
    parser.add_argument("--port", type=int, default=8191)
    args = parser.parse_args()
    rows, failed = [], 0
    with tempfile.TemporaryDirectory() as tmp:
        files = []
        for family, tiny in hf.FAMILIES.items():
            if tiny.gguf_arch:  # Mistral's sliding window is not in llama.cpp's files
                directory = Path(tmp) / family
                model = hf.build(family, directory, seed=0)
                gguf = hf.write_gguf(directory, directory / f"{family}.gguf", family)
                files.append((family, tiny.gguf_arch, model, gguf, prompts(family)))
        directory = Path(tmp) / "qwen3moe"
        model = moe.build(directory, seed=0)
        gguf, _ = moe.write_gguf(directory, directory / "qwen3moe.gguf")
        files.append(("qwen3moe", "qwen3moe", model, gguf, prompts(moe.VOCABULARY)))
        for family, arch, model, gguf, cases in files:
            want = [hf.greedy(model, prompt, NEW_TOKENS)[0] for prompt in cases]
            got = llamacpp_answers(args.llama_server, gguf, cases, args.port)
            equal = sum(a == b for a, b in zip(want, got))
            failed += equal != len(cases)
            rows.append(f"| {family} | {arch} | {equal}/{len(cases)} |")
            for prompt, a, b in zip(cases, want, got):
                if a != b:
                    print(f"{family}: prompt of {len(prompt)} tokens: transformers {a}, llama.cpp {b}")
    print("| family | GGUF architecture | llama.cpp's answers equal transformers' |\n|---|---|---|")
    print("\n".join(rows))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
