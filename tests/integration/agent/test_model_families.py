"""Model families and file formats beyond the default model, on tiny checkpoints written here: each
against the independent numpy reference, and the formats of one set of weights against each other."""

import numpy as np
import pytest
from conftest import TINY_RUNTIME
from test_model_reference import compare_logits

import reference_numpy as ref
import runner_calls as calls
from agent.contract.sampling import SamplingParams
from agent.model.checkpoint import CheckpointError
from agent.model.formats import load_checkpoint, ms_ckpt
from agent.model.tokenizer import load_tokenizer
from agent.runner import ModelRunner
from tiny_models import write_tiny_checkpoint, write_tiny_gguf

PROMPT = "The capital of France is Paris. 你好"
LLAMA3_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}

FAMILIES = {
    "llama2": dict(model_type="llama"),
    "llama3": dict(model_type="llama", extra_config={"rope_theta": 500000.0, "rope_scaling": LLAMA3_SCALING}),
    "llama-linear-rope": dict(
        model_type="llama", extra_config={"rope_scaling": {"type": "linear", "factor": 4.0}}
    ),
    "llama-tied": dict(model_type="llama", tied=True),
    "qwen2": dict(model_type="qwen2"),
    "qwen3": dict(model_type="qwen3", tied=True),
    "phi3": dict(model_type="phi3", extra_config={"sliding_window": 8}),
    "mistral": dict(model_type="mistral"),
    # every layer attends the last 8 positions: the 24 steps after the prompt run past the window
    "mistral-window": dict(model_type="mistral", extra_config={"sliding_window": 8}),
    "internlm2": dict(model_type="internlm2"),
}


def greedy_tokens(checkpoint_path, prompt_ids: list[int], n: int = 12) -> list[int]:
    runner = ModelRunner.from_checkpoint(load_checkpoint(checkpoint_path), TINY_RUNTIME)
    tokens = [calls.prefill(runner, 0, prompt_ids, SamplingParams())]
    tokens += [calls.decode(runner, [0])[0] for _ in range(n - 1)]
    return tokens


@pytest.mark.parametrize("family", FAMILIES)
def test_family_logits_match_reference(family, tmp_path):
    options = FAMILIES[family]
    directory = write_tiny_checkpoint(
        tmp_path / family,
        options["model_type"],
        seed=5,
        tied=options.get("tied", False),
        extra_config=options.get("extra_config"),
    )
    checkpoint = load_checkpoint(directory)
    assert checkpoint.spec.architecture == options["model_type"]
    runner = ModelRunner.from_checkpoint(checkpoint, TINY_RUNTIME)
    prompt = load_tokenizer(directory).encode(PROMPT)
    # Positions beyond the scaled RoPE's original 32 positions exercise the llama3 blend.
    diffs = compare_logits(runner, ref.load_hf_reference(directory), prompt, slot=0, steps=24)
    assert max(diffs) < 1e-3, diffs
    # The MindSpore checkpoint of this family holds exactly these weights and this spec.
    ckpt = tmp_path / f"{family}.ckpt"
    ms_ckpt.save(checkpoint, ckpt, progress=lambda items: items)
    reloaded = load_checkpoint(ckpt)
    assert reloaded.spec == checkpoint.spec and reloaded.tensors.keys() == checkpoint.tensors.keys()
    for name, tensor in checkpoint.tensors.items():
        np.testing.assert_array_equal(reloaded.tensors[name], tensor, err_msg=name)


def test_rope_scaling_changes_the_frequencies(tmp_path):
    plain = load_checkpoint(write_tiny_checkpoint(tmp_path / "a", seed=5)).spec
    scaled = load_checkpoint(
        write_tiny_checkpoint(tmp_path / "b", seed=5, extra_config={"rope_scaling": LLAMA3_SCALING})
    ).spec
    ratio = plain.rope_inv_freq() / scaled.rope_inv_freq()
    assert ratio[0] == pytest.approx(1.0) and ratio[-1] == pytest.approx(8.0)


def test_formats_of_the_same_weights_agree(tmp_path):
    """One set of llama weights as one safetensors file, as three shards with an index, as an F32
    GGUF (Q/K rows permuted the llama.cpp way), as a F16 GGUF, and as a MindSpore .ckpt."""
    single = write_tiny_checkpoint(tmp_path / "single", seed=7)
    sharded = write_tiny_checkpoint(tmp_path / "sharded", seed=7, shards=3)
    assert len(list(sharded.glob("*.safetensors"))) == 3
    gguf_f32 = write_tiny_gguf(single, tmp_path / "tiny-f32.gguf", "F32")
    ckpt = tmp_path / "tiny.ckpt"
    ms_ckpt.save(load_checkpoint(single), ckpt, progress=lambda items: items)

    prompt = load_tokenizer(single).encode(PROMPT)
    assert load_tokenizer(gguf_f32).encode(PROMPT) == prompt
    reference = ref.greedy(ref.load_hf_reference(single), prompt, 12)
    for path in (single, sharded, gguf_f32, ckpt):
        assert greedy_tokens(path, prompt) == reference, path
    formats = {load_checkpoint(p).format for p in (single, gguf_f32, ckpt)}
    assert formats == {"safetensors", "gguf", "ckpt"}


def test_qwen2_gguf_matches_safetensors(tmp_path):
    """Qwen2 keeps its Q/K rows unpermuted in GGUF, and has QKV biases."""
    directory = write_tiny_checkpoint(tmp_path / "q", "qwen2", seed=8, tied=True)
    gguf_path = write_tiny_gguf(directory, tmp_path / "q.gguf", "F32")
    prompt = load_tokenizer(directory).encode(PROMPT)
    assert greedy_tokens(gguf_path, prompt) == greedy_tokens(directory, prompt)


@pytest.mark.parametrize("qtype", ["F16", "Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q6_K"])
def test_quantized_gguf_logits_match_reference(qtype, tmp_path):
    """Rows of 256 so every type's blocks fit; the reference dequantizes the file on its own."""
    directory = write_tiny_checkpoint(
        tmp_path / "hf", seed=9, hidden=256, heads=4, kv_heads=2, intermediate=256
    )
    path = write_tiny_gguf(directory, tmp_path / f"tiny-{qtype}.gguf", qtype)
    import gguf

    types = {t.tensor_type.name for t in gguf.GGUFReader(str(path)).tensors}
    assert qtype in types, types
    runner = ModelRunner.from_checkpoint(load_checkpoint(path), TINY_RUNTIME)
    # every matrix is multiplied in its file's format
    assert runner.graphs.model.layers[0].formats.asnumpy().tolist() == [gguf.GGMLQuantizationType[qtype]] * 7
    prompt = load_tokenizer(path).encode(PROMPT)
    diffs = compare_logits(runner, ref.load_gguf_reference(path), prompt, slot=2, steps=3)
    assert max(diffs) < 1e-3, diffs


def test_unsupported_quantization_type_is_named(tmp_path):
    """Q8_1 is a GGML type (llama.cpp's activations) the gguf package has no dequantizer for."""
    directory = write_tiny_checkpoint(tmp_path / "hf", seed=9)
    path = write_tiny_gguf(directory, tmp_path / "q81.gguf", "Q8_1")
    with pytest.raises(CheckpointError, match=r"tensor [\w.]+ uses quantization type Q8_1, which"):
        load_checkpoint(path)


@pytest.mark.parametrize("kind", ["yarn", "dynamic", "longrope"])
def test_unsupported_rope_scaling_is_named(kind, tmp_path):
    directory = write_tiny_checkpoint(
        tmp_path / "m", extra_config={"rope_scaling": {"rope_type": kind, "factor": 4.0}}
    )
    with pytest.raises(CheckpointError, match=f"rope_scaling type '{kind}' is not supported"):
        load_checkpoint(directory)


def test_sharded_index_naming_a_missing_shard(tmp_path):
    directory = write_tiny_checkpoint(tmp_path / "m", seed=1, shards=2)
    (directory / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(CheckpointError, match="shard model-00002-of-00002.safetensors is missing"):
        load_checkpoint(directory)


def test_ckpt_without_a_spec_is_refused_clearly(tmp_path):
    import mindspore as ms

    path = tmp_path / "foreign.ckpt"
    ms.save_checkpoint(
        [{"name": "model.tok_embeddings.embedding_weight", "data": ms.Tensor(np.ones((4, 4), np.float32))}],
        str(path),
    )
    with pytest.raises(CheckpointError, match="no 'model_spec' entry.*tools.convert"):
        load_checkpoint(path)
    (tmp_path / "junk.ckpt").write_bytes(b"not a checkpoint")
    with pytest.raises(CheckpointError, match="not a readable MindSpore checkpoint"):
        load_checkpoint(tmp_path / "junk.ckpt")


def test_ckpt_in_half_precision_keeps_the_weights_to_fp16_precision(tmp_path, tiny_llama_dir):
    original = load_checkpoint(tiny_llama_dir)
    for dtype in ("float16", "bfloat16"):
        path = tmp_path / f"{dtype}.ckpt"
        ms_ckpt.save(original, path, progress=lambda items: items, dtype=dtype)
        loaded = load_checkpoint(path)
        assert loaded.spec == original.spec
        tolerance = 2**-8 if dtype == "float16" else 2**-7
        for name, tensor in original.tensors.items():
            np.testing.assert_allclose(
                loaded.tensors[name], tensor, rtol=tolerance, atol=1e-6, err_msg=f"{dtype} {name}"
            )
        assert path.stat().st_size < sum(t.nbytes for t in original.tensors.values()) * 0.6


def test_convert_tool_writes_a_servable_checkpoint_directory(tmp_path):
    """`python -m tools.convert` from a GGUF file: the output directory loads as a checkpoint and a
    tokenizer (chat template included) and generates the same tokens as the GGUF it came from."""
    import subprocess
    import sys

    from config.schema import PROJECT_ROOT

    source = write_tiny_gguf(write_tiny_checkpoint(tmp_path / "hf", seed=4), tmp_path / "t.gguf", "Q8_0")
    output = tmp_path / "converted"
    result = subprocess.run(
        [sys.executable, "-m", "tools.convert", str(source), str(output)],
        cwd=PROJECT_ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    assert "wrote" in result.stdout and "write: 100%" in result.stderr  # the progress bar
    assert sorted(p.name for p in output.iterdir()) == [
        "model.ckpt",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    original, converted = load_tokenizer(source), load_tokenizer(output)
    messages = [{"role": "user", "content": PROMPT}]
    assert converted.encode_chat(messages) == original.encode_chat(messages)
    prompt = original.encode(PROMPT)
    assert greedy_tokens(output, prompt) == greedy_tokens(source, prompt)

    missing = subprocess.run(
        [sys.executable, "-m", "tools.convert", str(tmp_path / "nope"), str(output)],
        cwd=PROJECT_ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert missing.returncode == 1 and "model path does not exist" in missing.stderr
