"""A tensor-parallel rank loads only its share of the weights (agent/model/checkpoint.py take_share):
its rows and columns read from the files (safetensors through a memory map, a GGUF's blocks that hold
them), in the compute dtype, equal to the slices of the whole model's; its host memory is about its
share. Greedy answers of a split model: test_tensor_parallel.py."""

import json
import shutil
import subprocess
import sys

import numpy as np
import pytest
from conftest import TINY_RUNTIME
from safetensors.numpy import load_file

from agent.known_answer import KnownAnswer
from agent.model.checkpoint import cut
from agent.model.formats import load_checkpoint, ms_ckpt
from agent.model.shard import LayerShare, TensorSplit
from config.schema import PROJECT_ROOT
from tiny_models import write_tiny_checkpoint, write_tiny_gguf
from tools.make_gguf import Shape, T, write_random_gguf

MB = 1 << 20
# The matrices a rank keeps in their GGUF format: Q4_K's blocks of 256 hold both ranks' columns of
# wo (cut at 128) and w_down (at 384), which are dequantized; Q8_0's and F16's of 32 never do.
ROWS = {f"layers.0.{name}" for name in ("wq", "wk", "wv", "w_gate", "w_up")}
KEPT = {
    "Q4_K": ROWS | {"embed", "lm_head"},
    "Q8_0": ROWS | {"layers.0.wo", "layers.0.w_down", "embed", "lm_head"},
    "F16": ROWS | {"layers.0.wo", "layers.0.w_down", "embed", "lm_head"},  # blocks of 32 for the kernels
}
KEPT["phi3-Q8_0"] = KEPT["Q8_0"]
# Peak resident memory of a process that loads one checkpoint (no MindSpore: the loaders need none);
# VmHWM, not ru_maxrss, which keeps the peak of the forked test process across exec.
PEAK_RSS = """
import json, sys
import psutil
from agent.model.formats import load_checkpoint, ms_ckpt
from agent.model.shard import TensorSplit
before = psutil.Process().memory_info().rss
ckpt = load_checkpoint(sys.argv[1], split=TensorSplit(int(sys.argv[2]), int(sys.argv[3])), dtype=sys.argv[4])
status = dict(line.split(":", 1) for line in open("/proc/self/status"))
peak = int(status["VmHWM"].split()[0]) * 1024
print(json.dumps({"grown": peak - before, "held": ckpt.weight_bytes()}))
"""


@pytest.fixture(scope="module")
def wide_llama(tmp_path_factory):
    """Rows of 256 and 768 weights, so a Q4_K matrix (blocks of 256) splits between two ranks inside
    a block: wo's columns at 128, w_down's at 384."""
    return write_tiny_checkpoint(
        tmp_path_factory.mktemp("wide") / "hf", hidden=256, heads=4, kv_heads=2, intermediate=768, layers=1
    )


def write_bf16(source, target):
    """The HuggingFace directory with its tensors stored as BF16, written by hand (numpy has none)."""
    shutil.copytree(source, target)
    header, chunks, offset = {}, [], 0
    for name, tensor in load_file(target / "model.safetensors").items():
        bits = (np.ascontiguousarray(tensor, np.float32).view(np.uint32) >> 16).astype(np.uint16)
        header[name] = {
            "dtype": "BF16",
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + bits.nbytes],
        }
        chunks.append(bits.tobytes())
        offset += bits.nbytes
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    (target / "model.safetensors").write_bytes(len(raw).to_bytes(8, "little") + raw + b"".join(chunks))
    return target


@pytest.mark.parametrize(
    "form", ["safetensors", "bf16", "Q4_K", "Q8_0", "F16", "internlm2", "phi3-Q8_0", "ckpt"]
)
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_each_rank_holds_the_slices_of_the_whole_model(wide_llama, tmp_path, form, dtype):
    if form == "internlm2":  # Q/K/V packed in one matrix: split once read whole
        path = write_tiny_checkpoint(tmp_path / "internlm2", "internlm2")
    elif form == "phi3-Q8_0":  # packed Q/K/V and gate/up in the file: each part's rows read from it
        shape = Shape(256, 1, 768, 4, 2, tied=False, arch="phi3")
        path = write_random_gguf(tmp_path / "phi3.gguf", shape, lambda *_: T.Q8_0)
    elif form == "safetensors":
        path = wide_llama
    elif form == "bf16":
        path = write_bf16(wide_llama, tmp_path / "bf16")
    elif form == "ckpt":  # MindSpore reads it whole: cut in memory
        path = tmp_path / "model.ckpt"
        ms_ckpt.save(load_checkpoint(wide_llama), path, progress=lambda items: items)
    else:
        path = write_tiny_gguf(wide_llama, tmp_path / f"{form}.gguf", form)
    whole = load_checkpoint(path)
    for rank in range(2):
        split = TensorSplit(rank, 2)
        share = load_checkpoint(path, split=split, dtype=dtype)
        cuts = LayerShare.of(whole.spec, split)
        assert share.split == split
        assert {*share.tensors, *share.blocks} == {*whole.tensors, *whole.blocks}
        for name in [*share.tensors, *share.blocks]:
            want = cut(whole.matrix(name), *cuts.cut(name))
            if name in share.blocks:  # a GGUF's format, kept where the share's edges fall between blocks
                assert share.blocks[name].qtype == whole.blocks[name].qtype
            elif want.ndim == 2:  # the other matrices in the compute dtype; norms and biases float32
                want = want.astype(dtype)
            assert share.matrix(name).dtype == want.dtype and np.array_equal(share.matrix(name), want), name
        assert set(share.blocks) == KEPT.get(form, set())
        # the whole model stays readable from the files, a tensor at a time (the known answer's)
        assert np.array_equal(share.whole().tensors["layers.0.wq"], whole.matrix("layers.0.wq"))
    assert share.shape("layers.0.w_down") == (whole.spec.hidden_size, whole.spec.intermediate_size // 2)


def test_a_ranks_known_answer_is_the_whole_models(wide_llama, tmp_path):
    """A rank's warm-up check compares the group's logits with the whole model's forward, read from the
    files a tensor at a time (the GGUF's matrices packed for the kernels' products as a whole load's)."""
    path = write_tiny_gguf(wide_llama, tmp_path / "q8.gguf", "Q8_0")
    whole = KnownAnswer.of_checkpoint(load_checkpoint(path), TINY_RUNTIME)
    share = KnownAnswer.of_checkpoint(load_checkpoint(path, split=TensorSplit(1, 2)), TINY_RUNTIME)
    assert np.array_equal(share.prefill_logits, whole.prefill_logits)
    assert np.array_equal(share.decode_logits, whole.decode_logits)


def peak_rss(path, split: TensorSplit, dtype: str) -> dict:
    done = subprocess.run(
        [sys.executable, "-c", PEAK_RSS, str(path), str(split.rank), str(split.size), dtype],
        capture_output=True,
        text=True,
        cwd=PROJECT_ROOT,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_a_ranks_host_memory_is_its_share_not_the_model(tmp_path):
    """Somewhat slow (5 s, 20 s on a busy machine): a 390 MB float32 checkpoint written, each rank's load
    measured in a process of its own."""
    path = write_tiny_checkpoint(
        tmp_path / "big", hidden=1024, heads=8, kv_heads=8, intermediate=4096, layers=6, seed=1
    )
    model = sum(f.stat().st_size for f in path.glob("*.safetensors"))
    for split, dtype, share in ((TensorSplit(1, 2), "float32", 0.5), (TensorSplit(0, 4), "float16", 0.125)):
        measured = peak_rss(path, split, dtype)
        assert measured["held"] < model * (share + 0.02)
        # the process grew by its share and a tensor being read, far below the model's 390 MB
        assert measured["grown"] < measured["held"] + 40 * MB, (measured, model)
