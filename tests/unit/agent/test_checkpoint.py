"""Loaders: the model spec comes from the files; bad files give clear errors."""

import json
import shutil

import numpy as np
import pytest

from agent.model.checkpoint import CheckpointError
from agent.model.formats import load_checkpoint
from agent.model.formats.gguf_file import unpermute_qk
from tiny_models import write_tiny_checkpoint


def test_llama_spec_comes_from_config(tiny_llama_dir):
    ckpt = load_checkpoint(tiny_llama_dir)
    spec = ckpt.spec
    assert (spec.architecture, spec.num_layers, spec.num_heads, spec.num_kv_heads) == ("llama", 2, 4, 2)
    assert (spec.head_dim, spec.qkv_bias, spec.tied_embeddings) == (16, False, False)
    assert ckpt.tensors["layers.1.wk"].shape == (32, 64)
    assert ckpt.tensors["lm_head"].dtype == np.float32


def test_qwen2_has_qkv_bias_and_tied_head(tiny_qwen2_dir):
    spec = load_checkpoint(tiny_qwen2_dir).spec
    assert spec.qkv_bias and spec.tied_embeddings and spec.architecture == "qwen2"


def test_default_gguf_spec(default_model_path):
    spec = load_checkpoint(default_model_path).spec
    assert (spec.num_layers, spec.hidden_size, spec.num_heads, spec.num_kv_heads) == (30, 576, 9, 3)
    assert (spec.vocab_size, spec.rope_theta, spec.tied_embeddings) == (49152, 100000.0, True)
    # <|im_end|> (the file's EOS), then <|endoftext|>: llama.cpp ends generation at both
    assert spec.eos_ids == (2, 0) and spec.bos_id == 1
    assert 134_000_000 < spec.parameter_count() < 135_000_000


def test_unpermute_restores_rotate_half_order():
    # One head of dim 4: llama.cpp stores rows as pairs (0, 2), (1, 3) interleaved: [r0, r2, r1, r3].
    hf_rows = np.arange(4 * 3, dtype=np.float32).reshape(4, 3)
    gguf_rows = hf_rows[[0, 2, 1, 3]]
    assert np.array_equal(unpermute_qk(gguf_rows, 1), hf_rows)


def test_missing_path(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist.*nope.gguf"):
        load_checkpoint(tmp_path / "nope.gguf")


def test_unknown_architecture(tmp_path):
    directory = write_tiny_checkpoint(tmp_path / "m", extra_config={"model_type": "gpt_neox"})
    with pytest.raises(CheckpointError, match="unsupported architecture 'gpt_neox'"):
        load_checkpoint(directory)


def test_corrupt_gguf(tmp_path, default_model_path):
    garbage = tmp_path / "garbage.gguf"
    garbage.write_bytes(b"not a gguf file at all" * 10)
    with pytest.raises(CheckpointError, match="not a readable GGUF file"):
        load_checkpoint(garbage)
    truncated = tmp_path / "truncated.gguf"
    with default_model_path.open("rb") as src:
        truncated.write_bytes(src.read(1_000_000))
    with pytest.raises(CheckpointError, match="truncated.gguf"):
        load_checkpoint(truncated)


def test_vocab_weight_mismatch(tmp_path):
    directory = write_tiny_checkpoint(tmp_path / "m")
    config = json.loads((directory / "config.json").read_text())
    config["vocab_size"] += 7
    (directory / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="vocab/weight mismatch"):
        load_checkpoint(directory)


def test_missing_tensor_and_missing_weights(tmp_path):
    from safetensors.numpy import load_file, save_file

    directory = write_tiny_checkpoint(tmp_path / "m")
    tensors = load_file(str(directory / "model.safetensors"))
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, str(directory / "model.safetensors"))
    with pytest.raises(CheckpointError, match="missing tensor layers.1.w_up"):
        load_checkpoint(directory)
    (directory / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="no \\*.safetensors"):
        load_checkpoint(directory)


def test_bf16_safetensors_load(tmp_path, tiny_llama_dir):
    """bf16 has no numpy dtype; the loader decodes it by hand."""
    import struct

    directory = tmp_path / "bf16"
    shutil.copytree(tiny_llama_dir, directory)
    from safetensors.numpy import load_file

    tensors = load_file(str(directory / "model.safetensors"))
    header, blobs, offset = {}, [], 0
    for name, array in tensors.items():
        bf16 = (array.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16).tobytes()
        header[name] = {
            "dtype": "BF16",
            "shape": list(array.shape),
            "data_offsets": [offset, offset + len(bf16)],
        }
        blobs.append(bf16)
        offset += len(bf16)
    raw = json.dumps(header).encode()
    (directory / "model.safetensors").write_bytes(struct.pack("<Q", len(raw)) + raw + b"".join(blobs))
    loaded = load_checkpoint(directory).tensors["embed"]
    original = tensors["model.embed_tokens.weight"]
    assert np.allclose(loaded, original, rtol=1e-2, atol=1e-2)  # bf16 keeps ~3 significant digits
