"""tools.make_gguf's random models: what their weights hold."""

import dataclasses

import numpy as np
import pytest

from agent.model.formats.gguf_header import GgufFile
from tools.make_gguf import Shape, mix, write_random_gguf


def test_a_llamas_output_projections_are_scaled_by_its_depth(tmp_path, default_model_path):
    """attn_output and ffn_down are 1/sqrt(2 x layers) the size of the other matrices (as trained
    models are initialised): a deep random model's layers then add little each to the residual
    stream, so rounding (int8 activations) moves its logits as little as a real model's."""
    layers = 8
    path = write_random_gguf(
        tmp_path / "deep.gguf", Shape(256, layers, 512, 4, 2), mix("F32"), tokenizer=default_model_path
    )
    sizes: dict[str, list[float]] = {}
    for tensor in GgufFile(path).tensors:
        if tensor.name.startswith("blk.") and tensor.name.endswith(".weight") and "norm" not in tensor.name:
            sizes.setdefault(tensor.name.split(".")[2], []).append(float(np.std(tensor.data)))
    expected = dict.fromkeys(sizes, 0.02) | {"attn_output": 0.005, "ffn_down": 0.005}  # 0.02 / sqrt(16)
    matrices = ["attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"]
    assert sorted(sizes) == sorted(matrices)
    for name, stds in sizes.items():
        assert np.allclose(stds, expected[name], rtol=0.05), (name, stds)


def test_the_moe_shapes_hold_their_models_total_and_active_weights():
    """qwen3-30b-a3b: Qwen3-30B-A3B's 30.5B weights, 3.3B a token (its vocabulary of 151,936);
    moe-7b-a1b: about 7B, 1B a token with the default tokenizer's 49,152; qwen35moe-a3b below."""
    from tools.make_gguf import SHAPES, tensor_shapes

    def counts(name: str, vocab: int, **changes) -> tuple[float, float]:
        shape = dataclasses.replace(SHAPES[name], **changes)
        total = active = 0
        for tensor, dims in tensor_shapes(shape):
            size = int(np.prod([vocab if d == -1 else d for d in dims]))
            total += size
            active += size * shape.experts_used // shape.experts if "_exps" in tensor else size
        return total / 1e9, active / 1e9

    total, active = counts("qwen3-30b-a3b", 151936)
    assert abs(total - 30.5) < 0.1 and abs(active - 3.3) < 0.1, (total, active)
    total, active = counts("moe-7b-a1b", 49152)
    assert 6.5 < total < 7.5 and 0.9 < active < 1.3, (total, active)
    # qwen35moe-a3b: Qwen3.5-35B-A3B's layers (with its 256 experts and 248,320 tokens: 35B weights,
    # 3.5B a token with the embedding and LM head) with 64 experts and the default tokenizer
    total, active = counts("qwen35moe-a3b", 248320, experts=256)
    assert abs(total - 34.7) < 0.1 and abs(active - 3.45) < 0.05, (total, active)
    total, active = counts("qwen35moe-a3b", 49152)
    assert abs(total - 9.7) < 0.1 and abs(active - 2.6) < 0.05, (total, active)


def test_arch_writes_a_dense_preset_in_another_familys_form(tmp_path, monkeypatch, capsys):
    """--arch: the same dense shape as a Qwen3 (QK-norm) or a Phi-3 (packed QKV and gate-up), to
    compare families of one size; a MoE preset is refused."""
    from tools import make_gguf

    dims = ["--hidden", "64", "--layers", "1", "--ffn", "128", "--heads", "4", "--kv-heads", "2"]
    for arch, marker in (("qwen3", "blk.0.attn_q_norm.weight"), ("phi3", "blk.0.attn_qkv.weight")):
        out = tmp_path / f"{arch}.gguf"
        argv = ["make_gguf", *dims, "--arch", arch, "--format", "F32", "--out", str(out)]
        monkeypatch.setattr("sys.argv", argv)
        assert make_gguf.main() == 0
        written = GgufFile(out)
        assert written.values["general.architecture"] == arch
        assert marker in {t.name for t in written.tensors}
    argv = ["make_gguf", "--shape", "moe-7b-a1b", "--arch", "qwen3", "--out", str(tmp_path / "x.gguf")]
    monkeypatch.setattr("sys.argv", argv)
    with pytest.raises(SystemExit):
        make_gguf.main()
    assert "not a dense" in capsys.readouterr().err


def test_the_smollm3_preset_holds_its_weights_and_every_fourth_layer_rotates_nothing(
    tmp_path, default_model_path
):
    """smollm3-3b: SmolLM3-3B's 3.08B weights (tied, its vocabulary of 128,256); a smollm3 file says
    nothing of NoPE, and the loader leaves layer i unrotated where (i + 1) % 4 == 0, as llama.cpp does."""
    from agent.model.formats import load_checkpoint
    from tools.make_gguf import SHAPES, tensor_shapes

    total = sum(
        int(np.prod([128256 if d == -1 else d for d in dims]))
        for _, dims in tensor_shapes(SHAPES["smollm3-3b"])
    )
    assert abs(total / 1e9 - 3.08) < 0.02, total
    path = write_random_gguf(
        tmp_path / "smollm3.gguf",
        Shape(64, 8, 128, 4, 2, arch="smollm3"),
        mix("F32"),
        tokenizer=default_model_path,
    )
    spec = load_checkpoint(path).spec
    assert spec.architecture == "smollm3" and spec.nope_layers == (3, 7)
    assert [spec.rope(i) for i in range(4)] == ["global", "global", "global", "none"]
