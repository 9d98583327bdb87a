"""tools.make_gguf's random models: what their weights hold."""

import numpy as np
from gguf import GGUFReader

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
    for tensor in GGUFReader(str(path)).tensors:
        if tensor.name.startswith("blk.") and tensor.name.endswith(".weight") and "norm" not in tensor.name:
            sizes.setdefault(tensor.name.split(".")[2], []).append(float(np.std(tensor.data)))
    expected = dict.fromkeys(sizes, 0.02) | {"attn_output": 0.005, "ffn_down": 0.005}  # 0.02 / sqrt(16)
    matrices = ["attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"]
    assert sorted(sizes) == sorted(matrices)
    for name, stds in sizes.items():
        assert np.allclose(stds, expected[name], rtol=0.05), (name, stds)
