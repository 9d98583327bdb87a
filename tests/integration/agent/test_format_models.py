"""A GGUF whose matrices hold every weight format the kernels multiply (agent/kernels/formats/), through
the graphs against the independent numpy reference (tests/support/reference_numpy.py, which dequantizes the
file's blocks with the gguf package): logits and greedy tokens for calls of 1 to 64 rows (a row at a
time, straight from the blocks, tiles dequantized whole), at every kernel target. Loading keeps each
matrix in its format (nothing dequantized), and the memory plan counts the file's sizes."""

import dataclasses
import functools

import gguf
import numpy as np
import pytest
from conftest import TINY_RUNTIME
from test_paged_kv import (
    PREFILL_BUCKETS,
    TOLERANCE,
    chunked_prefill,
    decode,
    decode_together,
    graphs_of,
    prompt_ids,
    shuffled_tables,
)

import reference_numpy as ref
from agent.kernels import has_int8_products
from agent.memory_plan import MB, MemoryPlanError, checkpoint_weights_bytes, refuse_what_cannot_fit
from agent.model.formats import gguf_file, load_checkpoint
from agent.model.quantized import FIELDS
from int8_comparison import Int8Comparison
from tools.make_gguf import Shape, write_random_gguf

T = gguf.GGMLQuantizationType
FORMATS = sorted(FIELDS, key=lambda t: t.value)  # 12: three layers' matrices hold each at least once
MATRICES = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
PHI3_MATRICES = ("attn_qkv", "attn_output", "ffn_up", "ffn_down")  # packed: 4 a layer, 12 in all


def format_of(tensor: str, layers: int, matrices: tuple[str, ...] = MATRICES) -> gguf.GGMLQuantizationType:
    if tensor == "token_embd.weight":
        return T.Q4_K
    if tensor == "output.weight":
        return T.Q6_K
    layer, matrix = int(tensor.split(".")[1]), tensor.split(".")[2]
    return FORMATS[(layer * len(matrices) + matrices.index(matrix)) % len(FORMATS)]


# The dense families' layers the kernels run: Llama's, Qwen3's (QK-norm, a head size that is not
# hidden / heads) and Phi-3's (packed QKV and gate-up, split at load with each part in the file's format)
LLAMA = Shape(hidden=256, layers=3, ffn=512, heads=4, kv_heads=2, tied=False)
ARCHITECTURES = {
    "llama": LLAMA,
    "qwen3": dataclasses.replace(LLAMA, arch="qwen3", head_dim=128),
    "phi3": dataclasses.replace(LLAMA, arch="phi3"),
}


# Seeds whose int8 comparison has steps free of near ties in the activations' rounding (qwen3's of
# seed 5 had none, each step then checked only within its ties' reach)
SEEDS = {"llama": 5, "qwen3": 6, "phi3": 5}


@pytest.fixture(scope="module", params=ARCHITECTURES)
def every_format_path(request, tmp_path_factory, default_model_path):
    """Rows of 256 and 512 weights (the K-quants' blocks), an LM head of its own."""
    path = tmp_path_factory.mktemp("formats") / f"every-format-{request.param}.gguf"
    shape = ARCHITECTURES[request.param]
    matrices = PHI3_MATRICES if shape.arch == "phi3" else MATRICES
    types = functools.partial(format_of, matrices=matrices)
    return write_random_gguf(path, shape, types, tokenizer=default_model_path, seed=SEEDS[request.param])


def test_every_matrix_is_kept_in_its_format_and_planned_at_the_files_size(every_format_path):
    checkpoint = load_checkpoint(every_format_path)
    kept = {name: matrix.qtype for name, matrix in checkpoint.blocks.items()}
    assert set(kept.values()) == set(FORMATS) and len(kept) == 3 * 7 + 2
    layer_norms = ("attn_norm", "ffn_norm") + (("q_norm", "k_norm") if checkpoint.spec.qk_norm else ())
    norms = {"final_norm"} | {f"layers.{i}.{n}" for i in range(3) for n in layer_norms}
    assert set(checkpoint.tensors) == norms
    file_matrices = sum(
        t.n_bytes for t in gguf.GGUFReader(str(every_format_path)).tensors if len(t.shape) == 2
    )
    assert sum(m.nbytes for m in checkpoint.blocks.values()) == file_matrices  # rows in whole tiles here
    norm_bytes = sum(t.nbytes for t in checkpoint.tensors.values())
    assert checkpoint_weights_bytes(checkpoint, TINY_RUNTIME) == file_matrices + norm_bytes


def test_every_format_matches_the_reference_at_every_row_count(every_format_path, kernel_target):
    """Prompts in chunks of 1, 2, 3, 5, 8, 13, 32 (= 64), 17 + 33 + 14, and 64 at once; then decode
    steps of 1, 2 and 3 sequences. Each chunk's logits and each step's are the reference's, and so is
    every greedy token where the reference's best two differ by more than the tolerance."""
    graphs = graphs_of(every_format_path)
    assert graphs.model.stack is not None and graphs.model.kept
    reference = ref.load_gguf_reference(every_format_path)
    vocab = graphs.spec.vocab_size
    tables = shuffled_tables(graphs, 3, seed=8)
    prompts = [prompt_ids(64, 40 + i, vocab) for i in range(3)]
    chunk_sizes = [[1, 2, 3, 5, 8, 13, 32], [17, 33], [64]]
    assert PREFILL_BUCKETS[-1] == 64
    diffs, tokens, caches = [], [], []
    for prompt, table, sizes in zip(prompts, tables, chunk_sizes):
        cache = ref.RefCache()
        want = ref.forward(reference, prompt, cache)
        got, ends = chunked_prefill(graphs, table, prompt, sizes)
        for logits, end in zip(got, ends):
            diffs.append(float(np.abs(logits - want[end - 1]).max()))
            best = np.sort(want[end - 1])[-2:]
            if best[1] - best[0] > TOLERANCE:
                assert int(np.argmax(logits)) == int(np.argmax(want[end - 1])), end
        caches.append(cache)
        tokens.append(int(np.argmax(want[-1])))
    assert max(diffs) < TOLERANCE, diffs
    # the sequences end at max_seq_len 64: decode after shorter prefixes in fresh tables
    tables = shuffled_tables(graphs, 3, seed=9)
    caches, tokens = [ref.RefCache() for _ in range(3)], []
    for table, cache, n in zip(tables, caches, (20, 9, 30)):
        prompt = prompt_ids(n, n, vocab)
        got, _ = chunked_prefill(graphs, table, prompt, [])
        want = ref.forward(reference, prompt, cache)[-1]
        assert np.abs(got[-1] - want).max() < TOLERANCE
        tokens.append(int(np.argmax(want)))
    steps = decode_together(graphs, reference, tables, caches, tokens, [20, 9, 30], 3)  # 3 rows
    steps += decode_together(graphs, reference, tables[:2], caches[:2], tokens[:2], [23, 12], 2)  # 2
    steps += decode_together(graphs, reference, tables[:1], caches[:1], tokens[:1], [25], 2)  # 1
    assert max(steps) < TOLERANCE, steps


def test_int8_activations_in_every_format_match_the_q8_1_reference(every_format_path, kernel_target):
    """runtime.activations int8 (int8_products.h): every integer format's products in the fused layer
    take Q8_1 activations at every row count (chunks of 3, 5, 13 and 32 tokens; a decode step of 3
    rows, read straight from the blocks up to 4 rows, through an unpacked tile above) and match the
    reference that rounds each layer product's input the same way, tie-aware (int8_comparison.py).
    The portable target has no byte dot products: int8 is refused there, naming the instruction sets."""
    if not has_int8_products():
        assert kernel_target == "portable"
        with pytest.raises(ValueError, match="needs kernels built with AVX2 or AVX512-VNNI"):
            graphs_of(every_format_path, activations="int8")
        return
    graphs = graphs_of(every_format_path, activations="int8")
    compared = Int8Comparison(ref.load_gguf_reference(every_format_path))
    vocab = graphs.spec.vocab_size
    tables = shuffled_tables(graphs, 3, seed=10)
    tokens, caches, ties = [], [], []
    for n, table in enumerate(tables):
        prompt, cache, near_ties = prompt_ids(53, 60 + n, vocab), ref.RefCache(), []
        got, ends = chunked_prefill(graphs, table, prompt, [3, 5, 13, 32])
        for logits, start, end in zip(got, [0, *ends], ends):
            token = compared.check(logits, prompt[start:end], cache, near_ties)
        tokens.append(token)
        caches.append(cache)
        ties.append(near_ties)
    got = decode(graphs, tables, tokens, [53] * 3)  # 3 rows, over the chunks' KV
    for logits, token, cache, near_ties in zip(got, tokens, caches, ties):
        compared.check(logits, [token], cache, near_ties)
    assert len(compared.exact) + len(compared.tied) == 15
    compared.assert_agrees(TOLERANCE, min_exact=2)


def test_a_model_that_cannot_fit_is_refused_before_loading(every_format_path, monkeypatch):
    """The plan from the file's header counts the weights as loading will hold them; a budget or a
    machine too small for it is refused naming the sizes, before any weight is read."""
    spec, weights = gguf_file.stored_weights(every_format_path)
    assert weights == checkpoint_weights_bytes(load_checkpoint(every_format_path), TINY_RUNTIME)
    tight = TINY_RUNTIME.model_copy(update={"memory_budget_mb": 10, "num_blocks": "auto"})
    with pytest.raises(MemoryPlanError, match=rf"does not hold the weights \({weights / MB:.0f} MB\)"):
        refuse_what_cannot_fit(every_format_path, tight)
    monkeypatch.setattr("agent.memory_plan.available_mb", lambda: 12.0)
    with pytest.raises(MemoryPlanError, match=r"does not fit: weights \d+ MB, .* 12 MB available"):
        refuse_what_cannot_fit(every_format_path, TINY_RUNTIME)
    refuse_what_cannot_fit(every_format_path, TINY_RUNTIME.model_copy(update={"matmul": "mindspore"}))


def test_a_type_without_a_kernel_loads_dequantized_and_says_so(tmp_path, default_model_path, caplog):
    """IQ4_NL (no kernel): that matrix loads as float32 with a warning naming its type and memory,
    and the layer multiplies it as float32 tiles beside its other matrices' blocks."""

    def types(tensor: str, layers: int) -> gguf.GGMLQuantizationType:
        return T.IQ4_NL if tensor == "blk.1.ffn_up.weight" else T.Q4_0

    path = write_random_gguf(
        tmp_path / "iq4.gguf", Shape(256, 2, 512, 4, 2), types, tokenizer=default_model_path, seed=3
    )
    with caplog.at_level("WARNING"):
        checkpoint = load_checkpoint(path)
    said = "blk.1.ffn_up.weight of type IQ4_NL has no CPU kernel: dequantized to float32"
    assert f"{said} (0.5 MB instead of 0.1 MB)" in caplog.text
    assert "layers.1.w_up" in checkpoint.tensors and "layers.1.w_up" not in checkpoint.blocks
    graphs = graphs_of(path)
    assert graphs.model.layers[1].formats.asnumpy().tolist() == [T.Q4_0] * 5 + [0, T.Q4_0]  # F32: 0
    reference = ref.load_gguf_reference(path)
    prompt = prompt_ids(20, 5, graphs.spec.vocab_size)
    got, _ = chunked_prefill(graphs, shuffled_tables(graphs, 1, seed=2)[0], prompt, [3])
    want = ref.forward(reference, prompt, ref.RefCache())
    assert np.abs(got[0] - want[2]).max() < TOLERANCE and np.abs(got[1] - want[-1]).max() < TOLERANCE
