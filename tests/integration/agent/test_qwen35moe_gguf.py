"""Qwen3.5-MoE as tools.make_gguf writes it in Q4_K_M (its routed experts 3-D, the shared expert and
its gate, the Gated DeltaNet layers' tensors, as llama.cpp's converter names them): loaded with every
expert kept in its format, its weights counted as the memory plan counts them, the kernels' products
equal to gguf's dequantized values, and the graphs (each layer's attention or DeltaNet fused, then
the experts' op) passing the agent's warm-up known-answer check, a numpy forward with the shared
expert, in float32 and with int8 activations. Against transformers: test_transformers_reference.py."""

import numpy as np
import pytest
from conftest import DEFAULT_RUNTIME
from gguf import GGUFReader

from agent.known_answer import KnownAnswer, numpy_forward, probe_tokens
from agent.model.formats import load_checkpoint
from agent.runner import ModelRunner
from agent.warm_up import warm_up
from tools.make_gguf import Shape, mix, write_random_gguf

# 4 layers (3 Gated DeltaNet, 1 gated attention), K-quant rows of whole 256-weight blocks
SHAPE = Shape(
    256,
    4,
    256,
    4,
    2,
    tied=False,
    arch="qwen35moe",
    head_dim=64,
    linear_heads=(2, 4),
    linear_dim=64,
    rotary=16,
    experts=4,
    experts_used=2,
    expert_ffn=256,
    shared_ffn=256,
)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, default_model_path):
    path = tmp_path_factory.mktemp("qwen35moe") / "qwen35moe.gguf"
    write_random_gguf(path, SHAPE, mix("Q4_K_M"), default_model_path, embed_scale=1.0)
    stored = {t.name: t.tensor_type.name for t in GGUFReader(str(path)).tensors}
    assert stored["blk.0.ffn_gate_exps.weight"] == "Q4_K" and stored["blk.0.ffn_up_shexp.weight"] == "Q4_K"
    assert stored["blk.3.ffn_down_shexp.weight"] == "Q6_K"  # llama.cpp's last layer, more bits
    assert stored["blk.0.ffn_gate_inp_shexp.weight"] == "F32"
    loaded = load_checkpoint(path)
    weights = sum(int(np.prod(t.shape)) for t in GGUFReader(str(path)).tensors)
    assert loaded.spec.parameter_count() == weights
    return loaded


def test_experts_and_the_shared_expert_stay_in_their_formats(checkpoint):
    spec = checkpoint.spec
    assert spec.architecture == "qwen35moe" and spec.shared_expert_intermediate_size == 256
    assert spec.linear_attention is not None and spec.linear_attention.layers == (0, 1, 2)
    kept = {name: m.qtype.name for name, m in checkpoint.blocks.items()}
    assert kept["layers.0.experts.3.w_gate"] == "Q4_K" and kept["layers.0.shared_expert.w_up"] == "Q4_K"
    assert kept["layers.3.shared_expert.w_down"] == "Q6_K"
    tokens = probe_tokens(spec.vocab_size, 12)
    dequantized, _, _ = numpy_forward(checkpoint, tokens)
    products, _, _ = numpy_forward(checkpoint, tokens, kernels=True)
    np.testing.assert_allclose(products, dequantized, rtol=0, atol=2e-4 * np.abs(dequantized).max())


@pytest.mark.parametrize("activations", ["float32", "int8"])
def test_warm_up_known_answer_agrees_with_the_graphs(checkpoint, activations):
    """Every layer fused (a DeltaNet's or attention's), then MoeFfn or MoeFfnI8 with the shared
    expert; the warm-up's probes restore states and run chunks, checked against numpy_forward."""
    runtime = DEFAULT_RUNTIME.model_copy(update={"activations": activations})
    runner = ModelRunner.from_checkpoint(checkpoint, runtime)
    layers = runner.graphs.model.layers
    assert all(layer.kernel_layer is not None and layer.moe is not None for layer in layers)
    assert runner.graphs.model.stack is None  # one op a layer, then the experts' op
    warm_up(runner, known=KnownAnswer.of_checkpoint(checkpoint, runner.runtime))
