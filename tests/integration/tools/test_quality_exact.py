"""python -m tools.quality.exact: one file in float32 and int8 activations compared over the whole
vocabulary on llama-perplexity's chunks. Its reference perplexity is the independent numpy
forward's over the same chunks; float32 against itself is refused; int8 moves the distributions
a little, not a lot."""

import json

import numpy as np
import pytest

import reference_numpy as ref
from agent.kernels import has_int8_products
from agent.model.tokenizer import load_tokenizer
from tiny_models import write_tiny_gguf
from tools.quality.exact import main

CTX = 32
CHUNKS = 3


@pytest.fixture(scope="module")
def tiny_q8(tmp_path_factory, tiny_llama_dir):
    return write_tiny_gguf(tiny_llama_dir, tmp_path_factory.mktemp("exact") / "tiny.q8_0.gguf", "Q8_0")


def test_the_same_mode_on_both_sides_is_refused(tiny_q8, capsys):
    with pytest.raises(SystemExit) as ended:
        main(["--model", str(tiny_q8), "--target", "float32", "--reference", "float32"])
    assert ended.value.code == 2 and "must differ" in capsys.readouterr().err


@pytest.mark.skipif(not has_int8_products(), reason="int8 activations need integer dot products")
def test_int8_against_float32_over_the_whole_vocabulary(tiny_q8, tmp_path):
    words = np.random.default_rng(0).choice(["tea", "rain", "cat", "river", "stone", "light"], 200)
    text = tmp_path / "text.txt"
    text.write_text(" ".join(words))
    argv = ["--model", str(tiny_q8), "--text", str(text), "--ctx", str(CTX), "--chunks", str(CHUNKS)]
    assert main([*argv, "--out", str(tmp_path), "--name", "q"]) == 0
    result = json.loads((tmp_path / "q.json").read_text())
    assert result["chunks"] == CHUNKS and result["positions"] == CHUNKS * (CTX // 2 - 1)
    tokenizer = load_tokenizer(tiny_q8)
    tokens, bos = tokenizer.encode(text.read_text()), tokenizer.encode("")
    reference = ref.load_gguf_reference(tiny_q8)
    nll = []
    for c in range(CHUNKS):
        ids = (bos + tokens[c * CTX + 1 : (c + 1) * CTX]) if bos else tokens[c * CTX : (c + 1) * CTX]
        logits = ref.forward(reference, ids, ref.RefCache()).astype(np.float64)
        logits -= logits.max(axis=1, keepdims=True)
        logprobs = logits - np.log(np.exp(logits).sum(axis=1, keepdims=True))
        nll += [-logprobs[i, ids[i + 1]] for i in range(CTX // 2, CTX - 1)]
    assert result["reference_perplexity"] == pytest.approx(float(np.exp(np.mean(nll))), rel=1e-4)
    assert 0 < result["kl_mean"] < 0.05 and result["top1_agreement"] > 0.8
    assert result["perplexity_ratio"] == pytest.approx(result["perplexity"] / result["reference_perplexity"])
