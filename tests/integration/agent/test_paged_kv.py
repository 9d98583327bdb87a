"""The paged KV cache through the graphs (agent/graphs/interface.py, agent/kernels): K/V written and
read through block tables, against the independent numpy reference (tests/support/reference_numpy.py).

The tables are shuffled blocks of the pool, so a kernel that read a sequence's positions as
contiguous rows, or one table for every row, would give other logits; prompts are prefilled in
chunks with boundaries anywhere (a chunk reads the positions before it from the cache)."""

import json
import subprocess
import sys

import numpy as np
import pytest
from conftest import TINY_RUNTIME

import reference_numpy as ref
from agent.contract.sampling import SamplingParams
from agent.contract.step import StepChunk
from agent.graphs.interface import bucket
from agent.graphs.step_graphs import StepGraphs, as_tensors
from agent.kernels import has_int8_products
from agent.known_answer import Int8AllowanceError, KnownAnswer
from agent.model.formats import load_checkpoint
from agent.runner import ModelRunner
from agent.warm_up import warm_up
from config.schema import PROJECT_ROOT
from int8_comparison import Int8Comparison
from tiny_models import write_tiny_checkpoint, write_tiny_gguf

TOLERANCE = 1e-3
PREFILL_BUCKETS, DECODE_BUCKETS = TINY_RUNTIME.prefill_buckets, TINY_RUNTIME.decode_batch_buckets
PATHS = {  # runtime settings of the three attention paths
    "fused": {},
    "op-by-op kernel attention": {"matmul": "mindspore"},
    "gather": {"decode_attention": "gather"},
}


def shuffled_tables(graphs: StepGraphs, n: int, seed: int) -> np.ndarray:
    """n block tables [n, MB] of distinct blocks from a permutation of the pool (the scratch slot's
    blocks left out: padded rows write there), not in order."""
    inputs = graphs.inputs
    usable = inputs.num_blocks - inputs.blocks_per_seq
    while True:
        blocks = np.random.default_rng(seed).permutation(usable)[: n * inputs.blocks_per_seq]
        if (np.diff(blocks) != 1).any():
            return blocks.reshape(n, inputs.blocks_per_seq).astype(np.int32)
        seed += 1


def prompt_ids(n: int, seed: int, vocab: int) -> list[int]:
    return np.random.default_rng(seed).integers(3, vocab, n).tolist()


def prefill(graphs: StepGraphs, table, tokens, start: int = 0) -> np.ndarray:
    length = bucket(PREFILL_BUCKETS, len(tokens))
    return graphs.prefill(table, np.asarray(tokens), length, start).asnumpy()[0]


def decode(graphs: StepGraphs, tables, tokens, positions) -> np.ndarray:
    positions = np.asarray(positions)
    rows = bucket(DECODE_BUCKETS, len(tokens))
    logits, _ = graphs.decode(tables, np.asarray(tokens), positions, rows, graphs.inputs.attend(positions))
    return logits.asnumpy()[: len(tokens)]


def chunked_prefill(
    graphs: StepGraphs, table, prompt: list[int], sizes: list[int]
) -> tuple[list[np.ndarray], list[int]]:
    """The prompt in chunks of `sizes` (then the rest) -> each chunk's last logits, and its end."""
    bounds = np.cumsum([0, *sizes])
    bounds = [int(b) for b in bounds if b < len(prompt)] + [len(prompt)]
    return [prefill(graphs, table, prompt[s:e], start=s) for s, e in zip(bounds, bounds[1:])], bounds[1:]


def prefill_each(graphs, reference, tables, prompts) -> tuple[list, list[float], list[int]]:
    """Each prompt prefilled whole into its table -> the reference's caches (for decode_together),
    max |logit difference| per prompt, and each prompt's next token (the reference's argmax)."""
    caches = [ref.RefCache() for _ in prompts]
    diffs, tokens = [], []
    for prompt, table, cache in zip(prompts, tables, caches):
        want = ref.forward(reference, prompt, cache)[-1]
        diffs.append(float(np.abs(prefill(graphs, table, prompt) - want).max()))
        tokens.append(int(np.argmax(want)))
    return caches, diffs, tokens


def decode_together(graphs, reference, tables, caches, tokens, positions, steps) -> list[float]:
    """`steps` decode steps of every sequence in one batch -> max |logit difference| per step;
    each sequence's next token is the reference's argmax (`tokens` is updated to the next ones)."""
    diffs = []
    positions = np.array(positions)
    for _ in range(steps):
        logits = decode(graphs, tables, tokens, positions)
        for i, cache in enumerate(caches):
            want = ref.forward(reference, [tokens[i]], cache)[-1]
            diffs.append(float(np.abs(logits[i] - want).max()))
            tokens[i] = int(np.argmax(want))
        positions += 1
    return diffs


@pytest.fixture(scope="module")
def head_dim_64_dir(tmp_path_factory):
    """Head dim 64: the attention's 64-column register path (the tiny model's head dim is 16); an FFN
    of 100, no multiple of 8 (the SwiGLU's eight-lane loop and its tail) nor of the product's tile."""
    return write_tiny_checkpoint(
        tmp_path_factory.mktemp("hd64"), "llama", seed=4, hidden=128, heads=2, kv_heads=1, intermediate=100
    )


def graphs_of(directory, **settings) -> StepGraphs:
    return StepGraphs(load_checkpoint(directory), TINY_RUNTIME.model_copy(update=settings))


@pytest.mark.parametrize(
    "path, model", [(path, "tiny") for path in PATHS] + [("fused", "head dim 64")], ids=lambda v: v
)
def test_shuffled_block_tables_match_the_reference(
    path, model, tiny_llama_dir, head_dim_64_dir, kernel_target
):
    """Three sequences of 7, 23 and 41 tokens (1, 2 and 3 blocks of 16) in shuffled blocks: prefill,
    then decode steps of all three at once (4 rows: one padding row in the scratch slot)."""
    directory = tiny_llama_dir if model == "tiny" else head_dim_64_dir
    graphs = graphs_of(directory, **PATHS[path])
    assert (graphs.model.layers[0].kernel_layer is not None) == (path == "fused")
    reference = ref.load_hf_reference(directory)
    tables = shuffled_tables(graphs, 3, seed=1)
    prompts = [prompt_ids(n, seed, graphs.spec.vocab_size) for seed, n in enumerate([7, 23, 41])]
    caches, diffs, tokens = prefill_each(graphs, reference, tables, prompts)
    diffs += decode_together(graphs, reference, tables, caches, tokens, [len(p) for p in prompts], 10)
    assert max(diffs) < TOLERANCE, diffs


@pytest.mark.parametrize("model", ["tiny", "head dim 64"])
@pytest.mark.parametrize(
    "sizes", [[5, 11, 1], [1, 1, 30], [16, 16]], ids=["5+11+1+rest", "1+1+30+rest", "16+16+rest"]
)
def test_prompt_prefilled_in_chunks_equals_the_whole_prompt(
    sizes, model, tiny_llama_dir, head_dim_64_dir, kernel_target
):
    """Each chunk's last logits are the reference's at that position; after the last chunk the
    sequence decodes as the whole-prompt prefill's does (both decoded in one batch). Head dim 64:
    rows attend in blocks of up to 8 sharing each key load, every row's arithmetic that of a row
    alone (agent/kernels/prompt_attention.h)."""
    directory = tiny_llama_dir if model == "tiny" else head_dim_64_dir
    graphs = graphs_of(directory)
    reference = ref.load_hf_reference(directory)
    whole_table, chunked_table = shuffled_tables(graphs, 2, seed=2)
    prompt = prompt_ids(45, 7, graphs.spec.vocab_size)
    want = ref.forward(reference, prompt, ref.RefCache())
    whole = prefill(graphs, whole_table, prompt)
    chunks, ends = chunked_prefill(graphs, chunked_table, prompt, sizes)
    assert len(chunks) == len(sizes) + 1
    for got, end in zip(chunks, ends):
        assert np.abs(got - want[end - 1]).max() < TOLERANCE, end
    assert np.abs(chunks[-1] - whole).max() < 1e-4
    first = int(np.argmax(whole))
    tables, tokens = np.stack([whole_table, chunked_table]), [first, first]
    for position in range(len(prompt), len(prompt) + 8):
        logits = decode(graphs, tables, tokens, [position, position])
        assert np.abs(logits[0] - logits[1]).max() < 1e-4, position
        tokens = [int(np.argmax(logits[0])), int(np.argmax(logits[1]))]
        assert tokens[0] == tokens[1]


@pytest.fixture(scope="module")
def tiny_q4_path(tmp_path_factory):
    """A tiny GGUF of Q4_1 layer matrices and a Q8_0 embedding (head dim 64), as the default model:
    the fused kernel's quantized products and the Q8_0 LM head (tied). FFN 320: the down product's
    k is 10 blocks of 32. Three layers: the whole stack's op (FusedStack) alternates its layers
    between two buffers, and the default model's 30 cover an even count."""
    directory = tmp_path_factory.mktemp("q4")
    hf = write_tiny_checkpoint(
        directory / "hf", seed=9, layers=3, hidden=256, heads=4, kv_heads=2, intermediate=320, tied=True
    )
    return write_tiny_gguf(hf, directory / "tiny-Q4_1.gguf", "Q4_1", embedding_qtype="Q8_0")


def test_q4_one_and_two_row_steps_read_through_the_tables(tiny_q4_path, kernel_target):
    """Chunks of 1 and 2 tokens and decode steps of 1 and 2 sequences run the Q4_1 products (one
    row: packed::row_tile; two: a block of packed::direct_rows)."""
    graphs = graphs_of(tiny_q4_path)
    assert graphs.model.stack is not None and graphs.model.kept
    reference = ref.load_gguf_reference(tiny_q4_path)
    tables = shuffled_tables(graphs, 2, seed=3)
    prompts = [prompt_ids(n, 10 + n, graphs.spec.vocab_size) for n in (20, 37)]
    caches = [ref.RefCache() for _ in prompts]
    diffs, tokens = [], []
    for prompt, table, cache, sizes in zip(prompts, tables, caches, [[2, 1, 2], [5, 2, 1, 13]]):
        want = ref.forward(reference, prompt, cache)
        chunks, ends = chunked_prefill(graphs, table, prompt, sizes)
        diffs += [float(np.abs(got - want[end - 1]).max()) for got, end in zip(chunks, ends)]
        tokens.append(int(np.argmax(want[-1])))
    positions = [len(p) for p in prompts]
    diffs += decode_together(graphs, reference, tables, caches, tokens, positions, 4)  # 2 rows
    alone = tokens[1:]  # then the second sequence alone: 1 row
    diffs += decode_together(graphs, reference, tables[1:], caches[1:], alone, [positions[1] + 4], 4)
    assert max(diffs) < TOLERANCE, diffs


def test_q4_steps_of_many_rows_match_the_reference(tiny_q4_path, kernel_target):
    """Prompts of 3 to 40 tokens and decode steps of 3 and 4 sequences: up to 32 rows the Q4_1
    tiles are multiplied straight from their blocks (26 rows: two blocks of 13), above 32 they are
    dequantized whole and multiplied as float32 tiles (40 rows; packed_matmul.h quantized_tile)."""
    graphs = graphs_of(tiny_q4_path, num_slots=5)
    reference = ref.load_gguf_reference(tiny_q4_path)
    tables = shuffled_tables(graphs, 4, seed=4)
    prompts = [prompt_ids(n, 20 + n, graphs.spec.vocab_size) for n in (3, 9, 26, 40)]
    caches, diffs, tokens = prefill_each(graphs, reference, tables, prompts)
    positions = [len(p) for p in prompts]
    diffs += decode_together(graphs, reference, tables, caches, tokens, positions, 3)  # 4 rows
    later = [p + 3 for p in positions[1:]]  # then three of them: 3 rows
    diffs += decode_together(graphs, reference, tables[1:], caches[1:], tokens[1:], later, 3)
    assert max(diffs) < TOLERANCE, diffs


def test_int8_activations_match_the_q8_1_reference(tiny_q4_path, kernel_target):
    """runtime.activations int8: calls of every row count (chunks of 8, 4 and 5 tokens; a mixed step
    of 2 decode rows and a 6-token chunk: 8 rows; a decode step of 3) multiply with Q8_1 activations
    (int8_products.h; test_weight_formats checks every row count's products), against the reference
    that rounds each layer product's input the same way, tie-aware (int8_comparison.py)."""
    if not has_int8_products():
        pytest.skip("the portable target has no int8 products (test_format_models checks the refusal)")
    graphs = graphs_of(tiny_q4_path, activations="int8")
    compared = Int8Comparison(ref.load_gguf_reference(tiny_q4_path))
    tables = shuffled_tables(graphs, 3, seed=6)
    vocab = graphs.spec.vocab_size
    a, b, c = prompt_ids(12, 31, vocab), prompt_ids(5, 32, vocab), prompt_ids(6, 33, vocab)
    caches = [ref.RefCache() for _ in range(3)]
    near_ties: list[list[int]] = [[], [], []]

    def check(got: np.ndarray, sequence: int, tokens: list[int]) -> int:
        return compared.check(got, tokens, caches[sequence], near_ties[sequence])

    check(prefill(graphs, tables[0], a[:8]), 0, a[:8])  # 8 rows: an unpacked tile
    next_a = check(prefill(graphs, tables[0], a[8:], start=8), 0, a[8:])  # 4 rows: straight from the blocks
    next_b = check(prefill(graphs, tables[1], b), 1, b)  # 5 rows
    rows = bucket(PREFILL_BUCKETS, 2 + len(c))
    logits, _ = graphs.mixed(
        tables[:2],
        np.array([next_a, next_b]),
        np.array([12, 5]),
        [StepChunk(2, c, tables[2], 0, SamplingParams())],
        rows,
        4,
    )
    got = logits.asnumpy()
    tokens = [check(got[i], i, [t]) for i, t in enumerate([next_a, next_b])]
    tokens.append(check(got[2], 2, c))
    got = decode(graphs, tables, tokens, [13, 6, 6])  # 3 rows
    for i, token in enumerate(tokens):
        check(got[i], i, [token])
    compared.assert_agrees(TOLERANCE, min_exact=4)


def test_an_int8_graph_past_its_allowance_is_told_apart_from_a_stale_cache(tiny_q4_path, tmp_path):
    """The warm-up's known-answer check with int8 activations against another model's answer (as
    logits that int8 moved too far look): the error stays Int8AllowanceError through the warm-up,
    so the agent says to serve with float32 activations instead of blaming the compile cache."""
    if not has_int8_products():
        pytest.skip("the portable target has no int8 products")
    runtime = TINY_RUNTIME.model_copy(update={"activations": "int8"})
    runner = ModelRunner.from_checkpoint(load_checkpoint(tiny_q4_path), runtime)
    hf = write_tiny_checkpoint(
        tmp_path / "hf", seed=3, layers=3, hidden=256, heads=4, kv_heads=2, intermediate=320, tied=True
    )
    other = load_checkpoint(write_tiny_gguf(hf, tmp_path / "other.gguf", "Q4_1", embedding_qtype="Q8_0"))
    with pytest.raises(Int8AllowanceError, match=r"the prefill length \d+ graph disagrees"):
        warm_up(runner, lambda _line: None, "mixed", KnownAnswer.of_checkpoint(other, runtime))


def test_int8_activations_are_refused_where_they_cannot_run(tiny_llama_dir, tiny_q4_path, monkeypatch):
    """A model without quantized layers (the kernels' int8 products mocked present, whatever this CPU
    has), and kernels without int8 products (mocked absent, whatever this CPU has)."""
    monkeypatch.setattr("agent.graphs.step_graphs.has_int8_products", lambda: True)
    with pytest.raises(ValueError, match="this model has none"):
        graphs_of(tiny_llama_dir, activations="int8")
    monkeypatch.setattr("agent.graphs.step_graphs.has_int8_products", lambda: False)
    with pytest.raises(ValueError, match="needs kernels built with AVX2 or AVX512-VNNI"):
        graphs_of(tiny_q4_path, activations="int8")


@pytest.mark.parametrize("block_size", [1, 8, 128])
def test_block_sizes_from_one_to_more_than_a_sequence(block_size, tiny_llama_dir):
    """Block size 1 (every position its own block), 8, and 128 (one block holds any sequence of
    max_seq_len 64): shuffled tables, chunked prefill, batched decode."""
    graphs = graphs_of(tiny_llama_dir, block_size=block_size)
    assert graphs.inputs.blocks_per_seq == -(-64 // block_size)
    reference = ref.load_hf_reference(tiny_llama_dir)
    tables = shuffled_tables(graphs, 3, seed=block_size)
    prompts = [prompt_ids(n, n, graphs.spec.vocab_size) for n in (3, 19, 30)]
    caches = [ref.RefCache() for _ in prompts]
    diffs, tokens = [], []
    for prompt, table, cache in zip(prompts, tables, caches):
        want = ref.forward(reference, prompt, cache)
        chunks, ends = chunked_prefill(graphs, table, prompt, [2, 9])
        diffs += [float(np.abs(got - want[end - 1]).max()) for got, end in zip(chunks, ends)]
        tokens.append(int(np.argmax(want[-1])))
    diffs += decode_together(graphs, reference, tables, caches, tokens, [len(p) for p in prompts], 6)
    assert max(diffs) < TOLERANCE, diffs


def test_table_entry_outside_the_pool_is_refused_before_the_graphs_run(tiny_llama_dir):
    graphs = graphs_of(tiny_llama_dir)
    pool = graphs.inputs.num_blocks
    table = graphs.inputs.slot_table(0).copy()
    table[1] = pool
    with pytest.raises(ValueError, match=f"entry {pool} is outside the pool of blocks 0..{pool - 1}"):
        graphs.prefill(table, np.array([1, 2, 3]), 16)
    tables = np.stack([graphs.inputs.slot_table(0), graphs.inputs.slot_table(1)])
    tables[1, 0] = -3
    with pytest.raises(ValueError, match="entry -3 is outside the pool"):
        graphs.decode(tables, np.array([1, 2]), np.array([3, 4]), 2)
    with pytest.raises(ValueError, match="entry"):
        graphs.kv_export(table, 4)


@pytest.mark.parametrize("path", ["fused", "op-by-op kernel attention", "whole stack (Q4_1)"])
def test_kernels_refuse_a_table_that_slipped_past_the_host(path, tiny_llama_dir, request):
    """Inputs made by hand, past GraphInputs' checks: the kernel refuses the call (MindSpore raises)
    instead of reading outside the cache, and the graphs keep working. The quantized model runs
    every layer in one op (FusedStack): a refusal of any layer refuses it."""
    if path == "whole stack (Q4_1)":
        directory = request.getfixturevalue("tiny_q4_path")
        graphs, reference = graphs_of(directory), ref.load_gguf_reference(directory)
        assert graphs.model.stack is not None
    else:
        graphs, reference = graphs_of(tiny_llama_dir, **PATHS[path]), ref.load_hf_reference(tiny_llama_dir)
    table = graphs.inputs.slot_table(0)
    arrays = list(graphs.inputs.decode(table[None, :], [1], [5], 1, 0))
    arrays[3] = np.full_like(arrays[3], graphs.inputs.num_blocks)  # tables [1, MB]
    with pytest.raises(RuntimeError, match="is 1"):
        graphs.decode_graph(*as_tensors(tuple(arrays)))
    prompt = prompt_ids(6, 0, graphs.spec.vocab_size)
    want = ref.forward(reference, prompt, ref.RefCache())[-1]
    assert np.abs(prefill(graphs, table, prompt) - want).max() < TOLERANCE


@pytest.mark.skipif(
    not has_int8_products(),
    reason="the int8 products need AVX2 or AVX512-VNNI (kernels of the native target have none)",
)
def test_agreement_tool_compares_greedy_answers(tiny_q4_path, tmp_path):
    """python -m tools.agreement: a config against itself agrees everywhere; int8 against float32
    reports, per prompt, where its answer first differs (or that it does not)."""
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"tell me about {w}"}) + "\n" for w in ("cats", "rain")))
    runtime = (
        "runtime: {num_slots: 2, max_seq_len: 64, memory_budget_mb: null, prefill_buckets: [16, 64], "
        "decode_batch_buckets: [1, 2], attend_buckets: [64], compile_cache_dir: null%s}\n"
    )
    configs = {}
    for name, extra in (("float32", ", activations: float32"), ("int8", ", activations: int8")):
        configs[name] = tmp_path / f"{name}.yaml"
        configs[name].write_text(f"model: {{path: {tiny_q4_path}}}\n" + runtime % extra)

    def agreement(config: str, against: str) -> dict:
        run = subprocess.run(
            [
                sys.executable,
                "-m",
                "tools.agreement",
                "--config",
                str(configs[config]),
                "--against",
                str(configs[against]),
                "--tokens",
                "8",
                "--batch",
                "2",
                "--prompts",
                str(prompts),
            ],
            cwd=PROJECT_ROOT,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert run.returncode == 0, run.stderr[-2000:]
        return json.loads((PROJECT_ROOT / "output" / "agreement.json").read_text())

    same = agreement("float32", "float32")
    assert same["answers_identical"] == 1.0 and same["tokens_before_first_difference"] == 1.0
    int8 = agreement("int8", "float32")
    assert [a["prompt_tokens"] for a in int8["answers"]] == [a["prompt_tokens"] for a in same["answers"]]
    assert all(a["first_difference"] is None or 0 <= a["first_difference"] < 8 for a in int8["answers"])
