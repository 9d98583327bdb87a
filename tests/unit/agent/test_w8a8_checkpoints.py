"""Int8 checkpoints in Hugging Face directories (agent/model/formats/int8_checkpoint.py): msModelSlim's
W8A8 (and its W8A8_DYNAMIC and W8A16) and compressed-tensors int8 load as Q8_0 blocks holding the file's
int8 values, with the scales Ascend's products take; the variants they do not support are refused,
naming what is supported. The graphs' run of them: tests/integration/agent/test_w8a8_models.py."""

import json
import logging
import re

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from agent.model.checkpoint import CheckpointError
from agent.model.formats import load_checkpoint
from agent.model.quantized import Q8_0, BlockMatrix
from agent.model.shard import TensorSplit
from int8_checkpoints import COMPRESSED_CONFIG, LINEARS, write_compressed_int8, write_modelslim
from tiny_models import write_tiny_checkpoint

MATRICES = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")
HF_OF = dict(zip(MATRICES, LINEARS))
MODELSLIM_SUPPORTED = (
    "supported: W8A8, W8A8_DYNAMIC and W8A16 with symmetric int8 weights per output channel, and FLOAT"
)
COMPRESSED_SUPPORTED = (
    "supported: format int-quantized or naive-quantized; weights num_bits 8, type int, symmetric, "
    "strategy channel or tensor; input_activations none, or num_bits 8, type int, symmetric, dynamic, "
    "strategy token"
)


@pytest.fixture(scope="module")
def float_qwen3(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("float") / "qwen3", "qwen3", seed=5)


def file_tensors(directory):
    (file,) = directory.glob("*.safetensors")
    return file, load_file(str(file))


def rewrite(directory, change) -> None:
    """The directory's safetensors file with `change` applied to its dict of tensors."""
    file, tensors = file_tensors(directory)
    change(tensors)
    save_file(tensors, str(file))


def refused(directory) -> str:
    with pytest.raises(CheckpointError) as caught:
        load_checkpoint(directory)
    return str(caught.value)


@pytest.mark.parametrize("deq_scale_dtype", ["int64", "float32"])
def test_modelslim_w8a8_loads_as_q8_0_blocks_of_the_files_int8(deq_scale_dtype, float_qwen3, tmp_path):
    int8_dir, dequantized = write_modelslim(float_qwen3, tmp_path, deq_scale_dtype=deq_scale_dtype)
    checkpoint, reference = load_checkpoint(int8_dir), load_checkpoint(dequantized)
    _, files = file_tensors(int8_dir)
    layer_matrices = {f"layers.{i}.{m}" for i in range(2) for m in MATRICES}
    assert set(checkpoint.blocks) == layer_matrices
    assert {b.qtype for b in checkpoint.blocks.values()} == {Q8_0}
    assert {"embed", "lm_head", "layers.0.q_norm"} <= set(checkpoint.tensors)  # FLOAT, as the file's
    for name in layer_matrices:
        hf = f"model.layers.{name.split('.')[1]}.{HF_OF[name.split('.')[2]]}."
        np.testing.assert_array_equal(checkpoint.int8_weight(name), files[hf + "weight"])
        np.testing.assert_array_equal(checkpoint.matrix(name), reference.tensors[name])  # scales exact here
        linear = checkpoint.int8[name]
        assert (linear.scheme, linear.input_scale, linear.input_offset) == ("static", 2.0**-5, 3.0)
        np.testing.assert_array_equal(linear.quant_bias, files[hf + "quant_bias"])
        assert linear.deq_scale.dtype == np.float32
        np.testing.assert_array_equal(linear.deq_scale * 2.0**5, linear.weight_scale)
    # Q8_0's 34 bytes a block of 32 weights (the float32 matrices' 128)
    q8_bytes = sum(b.nbytes for b in checkpoint.blocks.values())
    assert q8_bytes < 0.3 * sum(reference.tensors[n].nbytes for n in layer_matrices)


def test_w8a8_of_a_model_with_qkv_bias_carries_it_in_quant_bias(tmp_path):
    """Qwen2's Q/K/V biases: quant_bias holds them (the file's FLOAT copies are the NPU's to ignore)."""
    float_dir = write_tiny_checkpoint(tmp_path / "float", "qwen2", seed=5)
    int8_dir, dequantized = write_modelslim(float_dir, tmp_path, deq_scale_dtype="float32")
    checkpoint, reference = load_checkpoint(int8_dir), load_checkpoint(dequantized)
    original = load_checkpoint(float_dir)
    for bias in ("bq", "bk", "bv"):
        name = f"layers.1.{bias}"
        np.testing.assert_allclose(checkpoint.tensors[name], reference.tensors[name], rtol=1e-6)
        # quant_bias rounds each bias to a multiple of its row's deq_scale
        step = checkpoint.int8[f"layers.1.w{bias[1]}"].deq_scale
        assert (np.abs(checkpoint.tensors[name] - original.tensors[name]) <= step / 2 + 1e-7).all()


@pytest.mark.parametrize("quant_type, scheme", [("W8A8_DYNAMIC", "dynamic"), ("W8A16", "weight_only")])
def test_modelslim_dynamic_and_weight_only_types(quant_type, scheme, float_qwen3, tmp_path):
    int8_dir, dequantized = write_modelslim(
        float_qwen3, tmp_path, quant_type=quant_type, float_down_proj=True
    )
    checkpoint, reference = load_checkpoint(int8_dir), load_checkpoint(dequantized)
    assert "layers.0.w_down" in checkpoint.tensors and "layers.0.w_down" not in checkpoint.int8  # FLOAT
    assert checkpoint.int8["layers.1.w_up"].scheme == scheme
    np.testing.assert_array_equal(checkpoint.matrix("layers.1.w_up"), reference.tensors["layers.1.w_up"])


@pytest.mark.parametrize("input_activations", ["dynamic", None])
def test_compressed_tensors_int8_loads_as_q8_0_blocks(input_activations, float_qwen3, tmp_path):
    config = json.loads(json.dumps(COMPRESSED_CONFIG))
    if input_activations is None:
        config["config_groups"]["group_0"]["input_activations"] = None
    int8_dir, dequantized = write_compressed_int8(float_qwen3, tmp_path, config=config)
    checkpoint, reference = load_checkpoint(int8_dir), load_checkpoint(dequantized)
    assert len(checkpoint.blocks) == 14 and "lm_head" in checkpoint.tensors  # ignore: ["lm_head"]
    assert checkpoint.int8["layers.0.wk"].scheme == ("dynamic" if input_activations else "weight_only")
    for name in checkpoint.blocks:
        np.testing.assert_array_equal(checkpoint.matrix(name), reference.tensors[name])


def test_float32_scales_round_to_float16_within_2_to_the_minus_11(float_qwen3, tmp_path):
    int8_dir, dequantized = write_modelslim(float_qwen3, tmp_path, exact_scales=False, input_scale=0.0371)
    checkpoint, reference = load_checkpoint(int8_dir), load_checkpoint(dequantized)
    for name in checkpoint.blocks:
        want = reference.tensors[name]
        rows = np.abs(want).max(axis=1, keepdims=True)
        assert (np.abs(checkpoint.matrix(name) - want) <= rows * 2.0**-11).all(), name


def test_scales_float16_cannot_hold_keep_the_matrix_float32_saying_so(float_qwen3, tmp_path, caplog):
    """Weights ~1e-4 (scales ~1e-6, below float16's normal range) stay float32: exact, and logged."""
    tiny = tmp_path / "tiny-weights"
    tiny.mkdir()
    for file in float_qwen3.iterdir():
        (tiny / file.name).write_bytes(file.read_bytes())
    rewrite(tiny, lambda t: t.update({n: w * 1e-4 for n, w in t.items() if n.endswith("o_proj.weight")}))
    int8_dir, dequantized = write_modelslim(tiny, tmp_path, exact_scales=False)
    with caplog.at_level(logging.WARNING):
        checkpoint = load_checkpoint(int8_dir)
    assert re.search(
        r"int8 model\.layers\.0\.self_attn\.o_proj\.weight kept as float32 \(scales [\d.e-]+ to [\d.e-]+ "
        r"leave float16's normal range\): the Q8_0 kernels cannot take it",
        caplog.text,
    )
    assert "layers.0.wo" in checkpoint.tensors and "layers.0.wo" not in checkpoint.blocks
    reference = load_checkpoint(dequantized)
    np.testing.assert_allclose(checkpoint.tensors["layers.0.wo"], reference.tensors["layers.0.wo"], rtol=1e-6)
    _, files = file_tensors(int8_dir)
    np.testing.assert_array_equal(
        checkpoint.int8_weight("layers.0.wo"), files["model.layers.0.self_attn.o_proj.weight"]
    )


def test_q8_0_blocks_of_int8_rows_give_their_values_back():
    rng = np.random.default_rng(0)
    quants = rng.integers(-128, 128, (40, 96)).astype(np.int8)
    scales = rng.uniform(1e-4, 1e-1, 40).astype(np.float32)
    matrix = BlockMatrix.from_int8(quants, scales)
    np.testing.assert_array_equal(matrix.int8_quants(), quants)
    want = quants * scales.astype(np.float16).astype(np.float32)[:, None]
    np.testing.assert_array_equal(matrix.dequantize(), want)  # gguf's Q8_0 dequantization


def test_a_tensor_parallel_rank_takes_its_share_dequantized(float_qwen3, tmp_path):
    int8_dir, dequantized = write_modelslim(float_qwen3, tmp_path)
    share = load_checkpoint(int8_dir, split=TensorSplit(1, 2))
    reference = load_checkpoint(dequantized, split=TensorSplit(1, 2))
    assert not share.blocks and share.tensors.keys() == reference.tensors.keys()
    for name, tensor in reference.tensors.items():
        np.testing.assert_array_equal(share.tensors[name], tensor, err_msg=name)


# Refusals, each naming the format and what is supported


def test_modelslim_types_beyond_int8_per_channel_are_refused(float_qwen3, tmp_path):
    int8_dir, _ = write_modelslim(float_qwen3, tmp_path)
    description_path = int8_dir / "quant_model_description.json"
    description = json.loads(description_path.read_text())
    description["model.layers.1.mlp.up_proj.weight"] = "W4A16"
    description_path.write_text(json.dumps(description))
    assert refused(int8_dir) == (
        f"{description_path}: model.layers.1.mlp.up_proj.weight is W4A16, which is not supported "
        f"({MODELSLIM_SUPPORTED})"
    )


def test_modelslim_per_group_weights_are_refused(float_qwen3, tmp_path):
    int8_dir, _ = write_modelslim(float_qwen3, tmp_path, quant_type="W8A16")
    prefix = "model.layers.0.mlp.gate_proj."
    rewrite(int8_dir, lambda t: t.update({prefix + "weight_scale": np.ones((128, 2), np.float32)}))
    assert refused(int8_dir) == (
        f"{int8_dir / 'quant_model_description.json'}: {prefix}weight_scale [128, 2] is per group of 32 "
        "weights: only one scale an output channel is supported"
    )


def test_modelslim_asymmetric_weights_are_refused(float_qwen3, tmp_path):
    int8_dir, _ = write_modelslim(float_qwen3, tmp_path, quant_type="W8A8_DYNAMIC")
    prefix = "model.layers.1.self_attn.k_proj."
    rewrite(int8_dir, lambda t: t.update({prefix + "weight_offset": np.full((48, 1), 2.0, np.float32)}))
    assert refused(int8_dir) == (
        f"{int8_dir / 'quant_model_description.json'}: {prefix}weight_offset is not 0: asymmetric int8 "
        "weights are not supported (symmetric only)"
    )


def test_modelslim_per_channel_activation_scales_are_refused(float_qwen3, tmp_path):
    int8_dir, _ = write_modelslim(float_qwen3, tmp_path)
    prefix = "model.layers.0.self_attn.q_proj."
    rewrite(int8_dir, lambda t: t.update({prefix + "input_scale": np.ones(64, np.float16)}))
    assert refused(int8_dir) == (
        f"{int8_dir / 'quant_model_description.json'}: {prefix}input_scale has 64 values: only per-tensor "
        "activation quantization is supported"
    )


def test_modelslim_anti_outlier_norm_bias_is_refused(float_qwen3, tmp_path):
    int8_dir, _ = write_modelslim(float_qwen3, tmp_path)
    name = "model.layers.0.input_layernorm.bias"
    rewrite(int8_dir, lambda t: t.update({name: np.zeros(64, np.float32)}))
    assert refused(int8_dir) == (
        f"{int8_dir / 'quant_model_description.json'}: {name} is msModelSlim's anti-outlier norm "
        "parameter, which is not supported (export without anti-outlier suppression, or with one that "
        "leaves the norms without bias)"
    )


def test_a_quant_bias_where_the_layer_has_no_bias_is_refused(float_qwen3, tmp_path):
    """Qwen3's output projection has no bias: a quant_bias beyond the offset's correction is refused;
    one off by the rounding of that correction is not."""
    int8_dir, _ = write_modelslim(float_qwen3, tmp_path)
    prefix = "model.layers.1.self_attn.o_proj."
    rewrite(int8_dir, lambda t: t[prefix + "quant_bias"].__iadd__(1))
    load_checkpoint(int8_dir)
    rewrite(int8_dir, lambda t: t[prefix + "quant_bias"].__iadd__(1000))
    message = refused(int8_dir)
    assert message.startswith(
        f"{int8_dir}: {prefix}quant_bias carries a bias beyond the input offset's correction (up to "
    )
    assert message.endswith("), which a qwen3 wo has no place for")


@pytest.mark.parametrize(
    "change, what",
    [
        ({"format": "pack-quantized"}, "format 'pack-quantized'"),
        ({"weights": {"num_bits": 4}}, "group_0 weights of 4 bits, type 'int',"),
        ({"weights": {"type": "float"}}, "group_0 weights of 8 bits, type 'float',"),
        ({"weights": {"symmetric": False}}, "group_0 asymmetric weights"),
        ({"weights": {"strategy": "group", "group_size": 128}}, "group_0 weights of strategy 'group'"),
        (
            {"input_activations": {"dynamic": False, "strategy": "tensor"}},
            "group_0 input_activations (8 bits, type 'int', dynamic False, strategy 'tensor')",
        ),
        ({"input_activations": {"symmetric": False}}, "group_0 asymmetric input_activations"),
    ],
)
def test_compressed_tensors_variants_beyond_int8_per_channel_are_refused(change, what, float_qwen3, tmp_path):
    config = json.loads(json.dumps(COMPRESSED_CONFIG))
    group = config["config_groups"]["group_0"]
    for key, value in change.items():
        if key == "format":
            config["format"] = value
        else:
            group[key].update(value)
    int8_dir, _ = write_compressed_int8(float_qwen3, tmp_path, config=config)
    assert refused(int8_dir) == (
        f"{int8_dir / 'config.json'}: compressed-tensors {what} is not supported ({COMPRESSED_SUPPORTED})"
    )


def test_other_quantization_methods_are_refused(float_qwen3, tmp_path):
    directory = tmp_path / "gptq"
    directory.mkdir()
    for file in float_qwen3.iterdir():
        (directory / file.name).write_bytes(file.read_bytes())
    config = json.loads((directory / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": 128}
    (directory / "config.json").write_text(json.dumps(config))
    assert refused(directory) == (
        f"{directory / 'config.json'}: quantization_config quant_method 'gptq' is not supported "
        "(supported: compressed-tensors int8, and msModelSlim's W8A8 with its quant_model_description.json)"
    )
