"""Int8 checkpoints (msModelSlim W8A8, compressed-tensors int8; tests/support/int8_checkpoints.py) through
the graphs on CPU, their linears multiplied as Q8_0 blocks by the fused kernels, against the independent
numpy reference of what the files dequantize to; and the cells of Ascend's quantized products
(agent/graphs/quant_matmul.py): the reference in standard ops against numpy, the Ascend one traced.

Tolerances. With scales float16 holds (a compressed-tensors export in bfloat16 or float16, or the
power-of-two input_scale here), the Q8_0 blocks hold exactly the file's weights and the graphs match the
reference as any float checkpoint does (1e-3: float32 arithmetic against float64). With float32 scales,
each block's float16 scale is its row's to 2^-11 relative, so each of a layer's 4 chained products
(QKV, output, gate/up, down; the LM head is float) may scale a row's output by up to 2^-11: over 2
layers, at most about 8 x 2^-11 of the largest logit, to first order."""

import subprocess
import sys

import numpy as np
import pytest
from conftest import TINY_RUNTIME
from test_model_reference import compare_logits

import reference_numpy as ref
from agent.graphs.quant_matmul import Int8Matmul
from agent.kernels import has_int8_products
from agent.model.formats import load_checkpoint
from agent.model.quantized import Q8_0, Int8Linear
from agent.model.tokenizer import load_tokenizer
from agent.runner import ModelRunner
from config.schema import PROJECT_ROOT
from int8_checkpoints import quantize_rows, write_compressed_int8, write_modelslim
from int8_comparison import Int8Comparison
from tiny_models import write_tiny_checkpoint

PROMPT = "The capital of France is Paris. 你好"
LAYERS = 2
CHAINED_PRODUCTS = 4 * LAYERS


def written(kind: str, tmp_path, **options):
    """(int8 directory, dequantized float directory) of a tiny model of `kind`."""
    family = "qwen2" if kind == "modelslim-qwen2" else "qwen3"
    float_dir = write_tiny_checkpoint(tmp_path / "float", family, seed=5, layers=LAYERS)
    if kind == "compressed":
        return write_compressed_int8(float_dir, tmp_path, **options)
    if kind == "modelslim-qwen2":  # a bfloat16 model's export: deq_scale float32; Q/K/V biases
        return write_modelslim(float_dir, tmp_path, deq_scale_dtype="float32", **options)
    return write_modelslim(float_dir, tmp_path, **options)


@pytest.mark.parametrize("kind", ["modelslim", "modelslim-qwen2", "compressed"])
def test_int8_checkpoint_logits_match_its_dequantized_weights(kind, tmp_path):
    int8_dir, dequantized = written(kind, tmp_path)
    checkpoint = load_checkpoint(int8_dir)
    runner = ModelRunner.from_checkpoint(checkpoint, TINY_RUNTIME)
    layer = runner.graphs.model.layers[0]
    assert layer.kernel_layer is not None  # the fused kernel multiplies the Q8_0 blocks
    assert layer.formats.asnumpy().tolist() == [Q8_0] * 7
    prompt = load_tokenizer(int8_dir).encode(PROMPT)
    diffs = compare_logits(runner, ref.load_hf_reference(dequantized), prompt, slot=0, steps=6)
    print(f"{kind}: max |logit - reference| {max(diffs):.2e}")
    assert max(diffs) < 1e-3, diffs


def test_float32_scales_lose_at_most_float16s_rounding(tmp_path):
    """msModelSlim W8A8 of a float16 model with an input_scale and weight scales that float16 does not
    hold: each block's scale is rounded to float16 (module docstring)."""
    int8_dir, dequantized = written("modelslim", tmp_path, exact_scales=False, input_scale=0.0371)
    runner = ModelRunner.from_checkpoint(load_checkpoint(int8_dir), TINY_RUNTIME)
    reference = ref.load_hf_reference(dequantized)
    prompt = load_tokenizer(int8_dir).encode(PROMPT)
    largest = np.abs(ref.forward(reference, prompt, ref.RefCache())).max()
    diffs = compare_logits(runner, reference, prompt, slot=0, steps=6)
    bound = CHAINED_PRODUCTS * 2.0**-11 * largest
    print(
        f"float32 scales: max |logit - reference| {max(diffs):.2e} (bound {bound:.2e}, |logit| {largest:.1f})"
    )
    assert 1e-3 < max(diffs) < bound, diffs  # the rounding shows, within its reach


@pytest.mark.skipif(not has_int8_products(), reason="int8 activations need AVX2 or AVX512-VNNI kernels")
def test_w8a8_runs_with_int8_activations(tmp_path):
    """runtime.activations int8: the Q8_0 layer products take Q8_1-rounded activations, as a GGUF's do,
    against the reference that rounds the same inputs (tests/support/int8_comparison.py)."""
    int8_dir, dequantized = written("modelslim", tmp_path)
    runtime = TINY_RUNTIME.model_copy(update={"activations": "int8"})
    runner = ModelRunner.from_checkpoint(load_checkpoint(int8_dir), runtime)
    reference = ref.load_hf_reference(dequantized)
    for layer in reference.layers:
        layer["integer"] = {"q", "k", "v", "o", "gate", "up", "down"}
    compared = Int8Comparison(reference)
    prompt = load_tokenizer(int8_dir).encode(PROMPT)
    table = runner.graphs.inputs.slot_table(0)
    cache, near_ties = ref.RefCache(), []
    got = runner.graphs.prefill(table, np.asarray(prompt), 16).asnumpy()[0]
    token = compared.check(got, prompt, cache, near_ties)
    for position in range(len(prompt), len(prompt) + 4):
        got = runner.graphs.decode(table[None, :], np.array([token]), np.array([position]), 1, 32)[0]
        token = compared.check(got.asnumpy()[0], [token], cache, near_ties)
    compared.assert_agrees(1e-3, min_exact=1)


# The quantized products' cells


def linear_of(scheme: str, rows: int = 48, k: int = 64, seed: int = 0):
    """An Int8Linear of `scheme` with its int8 weights, as int8_checkpoint reads them."""
    rng = np.random.default_rng(seed)
    q, scale = quantize_rows(rng.standard_normal((rows, k)).astype(np.float32) / 8, exact_scales=False)
    if scheme != "static":
        return Int8Linear(scheme=scheme, weight_scale=scale), q
    input_scale, input_offset = 0.0371, 3.0
    deq = (np.float32(input_scale) * scale).astype(np.float32)
    quant_bias = (-3 * q.sum(axis=1) + rng.integers(-50, 50, rows)).astype(np.int32)
    linear = Int8Linear(
        scheme="static",
        weight_scale=(deq / np.float32(input_scale)).astype(np.float32),
        deq_scale=deq,
        quant_bias=quant_bias,
        input_scale=input_scale,
        input_offset=input_offset,
    )
    return linear, q


def numpy_product(linear: Int8Linear, q: np.ndarray, x: np.ndarray, dtype=np.float32) -> np.ndarray:
    """The module docstring's arithmetic in numpy float32 (rint: half to even, as ops.round); x, and
    the static input scale's reciprocal and offset, rounded to `dtype` first as the cell holds them."""
    x = x.astype(dtype).astype(np.float32)
    acc_of = lambda xq: (xq.astype(np.int64) @ q.T.astype(np.int64)).astype(np.float32)  # noqa: E731
    if linear.scheme == "weight_only":
        return x @ (q * linear.weight_scale[:, None]).T
    if linear.scheme == "static":
        reciprocal = np.float32(dtype(1.0 / linear.input_scale))
        xq = np.clip(np.rint(x * reciprocal + np.float32(linear.input_offset)), -128, 127)
        return (acc_of(xq) + linear.quant_bias) * linear.deq_scale
    token_scale = np.abs(x).max(axis=1, keepdims=True) / np.float32(127)
    token_scale = np.where(token_scale > 0, token_scale, np.float32(1))
    return acc_of(np.rint(x / token_scale)) * linear.weight_scale * token_scale


@pytest.mark.parametrize("scheme", ["static", "dynamic", "weight_only"])
def test_quantized_product_reference_cell_matches_numpy(scheme):
    import mindspore as ms
    from mindspore import Tensor

    from agent.graphs.quant_matmul import Int8Matmul

    linear, q = linear_of(scheme)
    x = np.random.default_rng(1).standard_normal((5, 64)).astype(np.float32)
    x[4] = 0  # a padding row
    cell = Int8Matmul(linear, q, "w", dtype=ms.float32)
    got = cell(Tensor(x)).asnumpy()
    want = numpy_product(linear, q, x)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    # against the float weights the CPU multiplies: only the activations' rounding apart
    floats = x @ (q * linear.weight_scale[:, None]).T
    if scheme == "static":
        floats = floats + (linear.quant_bias + linear.input_offset * q.sum(axis=1)) * linear.deq_scale
        step = linear.input_scale
    else:
        step = np.abs(x).max(axis=1, keepdims=True) / 127
    reach = 0.5 * step * (np.abs(q) * linear.weight_scale[:, None]).sum(axis=1) + 1e-5
    assert (np.abs(got - floats) <= reach).all()
    half = Int8Matmul(linear, q, "h", dtype=ms.float16)(Tensor(x, ms.float16)).asnumpy()
    np.testing.assert_allclose(half, numpy_product(linear, q, x, np.float16), rtol=2**-10, atol=1e-4)


def test_linears_sharing_an_input_join_into_one_product():
    import mindspore as ms
    from mindspore import Tensor

    from agent.graphs.quant_matmul import Int8Matmul, joined

    parts = [linear_of("static", rows=r, seed=s) for r, s in ((32, 2), (16, 3))]
    linear, q = joined([p[0] for p in parts], [p[1] for p in parts])
    x = Tensor(np.random.default_rng(4).standard_normal((3, 64)).astype(np.float32))
    together = Int8Matmul(linear, q, "qkv", dtype=ms.float32)(x).asnumpy()
    alone = [Int8Matmul(lin, w, f"p{i}", dtype=ms.float32)(x).asnumpy() for i, (lin, w) in enumerate(parts)]
    np.testing.assert_array_equal(together, np.concatenate(alone, axis=1))
    # the first linear's outputs scaled (the attention scale folded into Q's rows): exact, a power of 2
    linear, q = joined([p[0] for p in parts], [p[1] for p in parts], output_scales=[0.125, 1.0])
    scaled = Int8Matmul(linear, q, "scaled", dtype=ms.float32)(x).asnumpy()
    np.testing.assert_array_equal(scaled, np.concatenate([alone[0] * 0.125, alone[1]], axis=1))
    other = Int8Linear(**{**parts[1][0].__dict__, "input_offset": 5.0})
    with pytest.raises(ValueError, match="different activation quantization"):
        joined([parts[0][0], other], [parts[0][1], parts[1][1]])


@pytest.mark.parametrize("scheme", ["static", "dynamic", "weight_only"])
def test_ascend_cell_traces_to_the_quantized_kernels(scheme):
    """The Ascend cell's graph (MindSpore's front end only: CPU has no kernel for these ops)."""
    import mindspore as ms
    from mindspore import Tensor

    from agent.graphs.op_check import traced_ops
    from agent.graphs.quant_matmul import AscendInt8Matmul

    linear, q = linear_of(scheme)
    cell = AscendInt8Matmul(linear, q, "w", dtype=ms.float16)
    ops_of = traced_ops(cell, (Tensor(np.zeros((4, 64), np.float16)),))
    kernels = {
        "static": {"QuantV2", "QuantBatchMatmul"},
        "dynamic": {"DynamicQuantExt", "QuantBatchMatmul"},
        "weight_only": {"WeightQuantBatchMatmul"},
    }
    assert kernels[scheme] <= ops_of, ops_of


# the reference's names of a layer's products -> the checkpoint's
PRODUCTS = {"q": "wq", "k": "wk", "v": "wv", "o": "wo", "gate": "w_gate", "up": "w_up", "down": "w_down"}


def quantized_activations(checkpoint):
    """What each int8 product does to its input before multiplying (agent/graphs/quant_matmul.py),
    in numpy: static (W8A8) clip(round(x / input_scale + input_offset)) less the offset, times the
    scale; dynamic, each row rounded to its own max |x| / 127."""

    def rounded(a: np.ndarray, layer: int, name: str) -> np.ndarray:
        linear = checkpoint.int8[f"layers.{layer}.{PRODUCTS[name]}"]
        if linear.scheme == "static":
            scale, offset = float(linear.input_scale), float(linear.input_offset)
            return (np.clip(np.round(a / scale + offset), -128, 127) - offset) * scale
        step = np.abs(a).max(-1, keepdims=True) / 127
        step = np.where(step > 0, step, 1.0)
        return np.round(a / step) * step

    return rounded


@pytest.mark.parametrize("kind", ["modelslim", "compressed"])
def test_the_paged_backend_runs_int8_checkpoints_as_quantized_products(kind, tmp_path):
    """Where MindSpore's ops run the layers (Ascend's configuration: matmul mindspore, paged
    attention; its reference on CPU), an int8 checkpoint's linears are quantized products, the
    activations quantized as Ascend's kernels do (static W8A8, dynamic per token), not dequantized
    weights: the logits of a prompt and 4 decode steps follow the numpy reference with that
    quantization within float32 rounding, and are far from the reference without it."""
    int8_dir, dequantized = written(kind, tmp_path)
    checkpoint = load_checkpoint(int8_dir)
    paged = TINY_RUNTIME.model_copy(update={"decode_attention": "paged", "matmul": "mindspore"})
    runner = ModelRunner.from_checkpoint(checkpoint, paged)
    layer = runner.graphs.model.layers[0]
    assert layer.int8_products and type(layer.wqkv) is Int8Matmul
    assert layer.wqkv.scheme == ("static" if kind == "modelslim" else "dynamic")
    reference, cache, plain = ref.load_hf_reference(dequantized), ref.RefCache(), ref.RefCache()
    rounded = quantized_activations(checkpoint)
    table = runner.graphs.inputs.slot_table(0)
    prompt = load_tokenizer(int8_dir).encode(PROMPT)
    got = runner.graphs.prefill(table, np.asarray(prompt), 32).asnumpy()[0]
    want = ref.forward(reference, prompt, cache, activations=rounded)[-1]
    apart = np.abs(got - ref.forward(reference, prompt, plain)[-1]).max()
    diffs = [np.abs(got - want).max()]
    token, position = int(np.argmax(want)), len(prompt)
    for _ in range(4):
        got = runner.graphs.decode(table[None], np.array([token]), np.array([position]), 1)[0].asnumpy()[0]
        want = ref.forward(reference, [token], cache, activations=rounded)[-1]
        diffs.append(np.abs(got - want).max())
        token, position = int(np.argmax(want)), position + 1
    print(f"{kind}: max |logit - quantized reference| {max(diffs):.2e}, from the float one {apart:.2f}")
    assert max(diffs) < 1e-3 < 0.05 < apart, (diffs, apart)


@pytest.mark.parametrize("kind, quantize", [("modelslim", "QuantV2"), ("compressed", "DynamicQuantExt")])
def test_the_ascend_graphs_of_an_int8_checkpoint_multiply_in_quantized_kernels(kind, quantize, tmp_path):
    """python -m tools.ascend_ops over a tiny checkpoint of each format with the Ascend configuration:
    every step graph quantizes its activations and multiplies in QuantBatchMatmul, keeps the kernels'
    contract, and uses only ops MindSpore runs on Ascend."""
    int8_dir, _ = written(kind, tmp_path)
    command = [sys.executable, "-m", "tools.ascend_ops", "--config", "config/qwen3_8b_ascend.yaml"]
    done = subprocess.run(
        [*command, "--model", str(int8_dir)], cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stdout + done.stderr
    listed = dict(line.split(": ", 1) for line in done.stdout.splitlines()[1:] if "->" not in line)
    for graph in ("prefill", "decode", "mixed"):
        assert {quantize, "QuantBatchMatmul"} <= set(listed[graph].split()), graph
    assert listed["not on Ascend"] == "none" and listed["contract"] == "passed"
