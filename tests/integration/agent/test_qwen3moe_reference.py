"""Qwen3-MoE (agent/model/families/qwen3moe.py, agent/graphs/moe.py) against Hugging Face
`transformers`, its reference implementation (the `reference` extra): a tiny model built by
transformers (2 layers, 8 experts of which 2 a token, normalised weights) with random float32 weights
and Qwen3's real vocabulary, served from its Hugging Face directory and from the GGUF llama.cpp's
converter writes (3-D expert tensors): greedy answers equal transformers' `generate` for prompts of
5 to 150 tokens. Experts in a block format (Q8_0 quantized from the model, Q4_K random blocks) are
multiplied by the kernels in that format; their reference is the transformers model holding the
format's dequantized values. As in test_transformers_reference.py, the seeds give no near-ties."""

from pathlib import Path

import numpy as np
import pytest
from conftest import DEFAULT_RUNTIME

import hf_moe_reference as moe
import hf_reference as hf
import runner_calls as calls
from agent.contract.sampling import SamplingParams
from agent.known_answer import KnownAnswer
from agent.model.formats import load_checkpoint
from agent.model.tokenizer import load_tokenizer
from agent.runner import ModelRunner
from agent.warm_up import warm_up

NEW_TOKENS = 12
NEAR_TIE = 1e-3
SUITE_TEXTS = (5, 20, 33)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> tuple[object, list[Path]]:
    directory = tmp_path_factory.mktemp("qwen3moe")
    model = moe.build(directory, seed=0)
    gguf_path, _ = moe.write_gguf(directory, directory / "qwen3moe.gguf")
    return model, [directory, gguf_path]


def prompts() -> list[list[int]]:
    tokenizer = load_tokenizer(hf.vocabulary_path(moe.VOCABULARY))
    texts = hf.suite_texts(moe.VOCABULARY)
    long = tokenizer.encode(" ".join(texts))[:150]
    assert len(long) == 150
    suite = [tokenizer.encode(texts[i]) for i in SUITE_TEXTS]
    return [tokenizer.encode("The capital of France is"), long, *suite]


def reference_answers(model, cases: list[list[int]]) -> list[list[int]]:
    answers = []
    for prompt in cases:
        answer, gap = hf.greedy(model, prompt, NEW_TOKENS)
        assert gap > NEAR_TIE, (len(prompt), gap)
        answers.append(answer)
    return answers


def served_answers(path: Path, cases: list[list[int]], runtime=DEFAULT_RUNTIME) -> list[list[int]]:
    runner = ModelRunner.from_checkpoint(load_checkpoint(path), runtime)
    assert runner.graphs.model.stack is None  # MoE layers: attention fused, then the experts' op
    answers = []
    for prompt in cases:
        got = [calls.prefill(runner, 0, prompt, SamplingParams())]
        got += [calls.decode(runner, [0])[0] for _ in range(NEW_TOKENS - 1)]
        runner.release(0)
        answers.append(got)
    return answers


def test_greedy_answers_equal_transformers(tiny):
    model, paths = tiny
    cases = prompts()
    want = reference_answers(model, cases)
    assert len({tuple(a) for a in want}) == len(want)  # the prompts lead to different answers
    for path in paths:
        assert served_answers(path, cases) == want, path.name


def test_both_files_hold_every_expert_and_route_to_several(tiny):
    """Both files load to the same experts; the reference's router spreads the prompts' tokens over
    most of the experts (so the answers above depend on the routing, not on one expert)."""
    import torch

    model, (directory, gguf_path) = tiny
    hf_ckpt, gguf_ckpt = load_checkpoint(directory), load_checkpoint(gguf_path)
    assert hf_ckpt.spec.num_experts == gguf_ckpt.spec.num_experts == 8
    assert hf_ckpt.spec.experts_per_token == gguf_ckpt.spec.experts_per_token == 2
    for name in ("layers.1.experts.5.w_gate", "layers.0.experts.7.w_down", "layers.1.router"):
        assert np.array_equal(hf_ckpt.matrix(name), gguf_ckpt.matrix(name)), name
    with torch.no_grad():
        out = model(torch.tensor([prompts()[1]]), output_router_logits=True)
    for logits in out.router_logits:
        chosen = torch.topk(logits, 2, dim=-1).indices
        assert len(torch.unique(chosen)) >= 6


def test_chunks_and_a_prefix_cache_hit_give_the_same_answer(tiny):
    """The 150-token prompt in two chunks (64, then the rest), and a second slot starting from the
    first's 128 cached positions: transformers' greedy answer each time."""
    model, paths = tiny
    prompt = prompts()[1]
    want, _ = hf.greedy(model, prompt, NEW_TOKENS)
    runner = ModelRunner.from_checkpoint(load_checkpoint(paths[1]), DEFAULT_RUNTIME)
    first = runner.graphs.inputs.slot_table(0)
    calls.prefill_chunk(runner, 0, prompt[:64], first)
    got = [calls.prefill(runner, 0, prompt, SamplingParams(), first, start=64)]
    got += [calls.decode(runner, [0], [first])[0] for _ in range(NEW_TOKENS - 1)]
    assert got == want
    second = runner.graphs.inputs.slot_table(1)
    shared = 128 // DEFAULT_RUNTIME.block_size
    second[:shared] = first[:shared]
    got = [calls.prefill(runner, 1, prompt, SamplingParams(), second, start=128)]
    got += [calls.decode(runner, [1], [second])[0] for _ in range(NEW_TOKENS - 1)]
    assert got == want


def test_speculative_steps_keep_transformers_answer(tiny):
    """The 150-token prompt decoded by speculative steps (proposals of transformers' own answer,
    every other one with a wrong second token: the right ones kept, the wrong one's position written
    over): the draft rows of a step go through the experts together."""
    model, paths = tiny
    prompt = prompts()[1]
    want, _ = hf.greedy(model, prompt, NEW_TOKENS)
    runner = ModelRunner.from_checkpoint(load_checkpoint(paths[0]), DEFAULT_RUNTIME)
    table = runner.graphs.inputs.slot_table(0)
    got, gave = [calls.prefill(runner, 0, prompt, SamplingParams(), table)], []
    while len(got) < NEW_TOKENS - 3:
        right = want[len(got) : len(got) + 3]
        proposals = right if len(gave) % 2 == 0 else [right[0], (right[1] + 1) % runner.spec.vocab_size]
        decoded, _ = calls.step(runner, [0], [table], [], drafts={0: proposals})
        got += decoded[0]
        gave.append(len(decoded[0]))
    assert got == want[: len(got)] and gave[:2] == [4, 2], gave


def test_a_batch_of_sequences_decodes_each_ones_answer(tiny):
    """Four sequences decoded together (rows of one step routed to different experts, grouped by
    expert in the op): each gets its own transformers answer."""
    model, paths = tiny
    cases = prompts()[:4]
    want = reference_answers(model, cases)
    runner = ModelRunner.from_checkpoint(load_checkpoint(paths[0]), DEFAULT_RUNTIME)
    got = [[calls.prefill(runner, slot, prompt, SamplingParams())] for slot, prompt in enumerate(cases)]
    for _ in range(NEW_TOKENS - 1):
        for answer, token in zip(got, calls.decode(runner, list(range(len(cases))))):
            answer.append(token)
    assert got == want


def test_warm_up_known_answer_agrees_with_the_graphs(tiny):
    """The agent's warm-up check (a numpy forward of the loaded weights, MoE layers included)
    passes on the compiled graphs."""
    _, paths = tiny
    checkpoint = load_checkpoint(paths[1])
    runner = ModelRunner.from_checkpoint(checkpoint, DEFAULT_RUNTIME)
    warm_up(runner, known=KnownAnswer.of_checkpoint(checkpoint, runner.runtime))


# Block formats for the experts: (type, the model's hidden and expert sizes: the K-quants' rows are
# whole 256-weight blocks)
FORMATS = {"Q8_0": (moe.T.Q8_0, 64), "Q4_K": (moe.T.Q4_K, 256)}


@pytest.mark.parametrize("name", FORMATS)
def test_experts_in_a_block_format_answer_as_their_dequantized_values(tmp_path, name):
    qtype, size = FORMATS[name]
    model = moe.build(tmp_path, seed=1, hidden=size, expert_ffn=size, head_dim=64)
    path, experts = moe.write_gguf(tmp_path, tmp_path / f"qwen3moe-{name}.gguf", qtype, seed=1)
    checkpoint = load_checkpoint(path)
    kept = {m.qtype for n, m in checkpoint.blocks.items() if ".experts." in n}
    assert kept == {qtype} and len(checkpoint.blocks) == 2 * 8 * 3
    reference = moe.with_experts(model, experts)
    cases = prompts()[:3]
    want = reference_answers(reference, cases)
    assert served_answers(path, cases) == want


def test_dense_layers_of_mlp_only_layers_answer_as_transformers(tmp_path):
    """transformers' mlp_only_layers: layer 0 a dense SwiGLU, layer 1 the experts (the HF files only:
    llama.cpp's qwen3moe has no dense layers)."""
    model = moe.build(tmp_path, seed=2, mlp_only_layers=[0])
    checkpoint = load_checkpoint(tmp_path)
    assert checkpoint.spec.dense_layers == (0,) and "layers.0.w_gate" in checkpoint.tensors
    cases = prompts()[:3]
    assert served_answers(tmp_path, cases) == reference_answers(model, cases)


def test_make_gguf_writes_a_qwen3moe_the_graphs_run_as_its_dequantized_values(tmp_path, default_model_path):
    """tools.make_gguf's qwen3moe (Q4_K_M: experts Q4_K, ffn_down_exps Q6_K in llama.cpp's layers
    with more bits, the router F32) holds 3-D expert tensors; loaded, each expert is kept in its
    format, and the graphs' logits (the warm-up's known-answer check against the kernels' products)
    equal a numpy forward of gguf's dequantized weights."""
    from gguf import GGUFReader

    from agent.known_answer import numpy_forward, probe_tokens
    from tools.make_gguf import Shape, mix, write_random_gguf

    shape = Shape(256, 2, 512, 4, 2, arch="qwen3moe", head_dim=64, experts=4, experts_used=2, expert_ffn=256)
    path = write_random_gguf(tmp_path / "moe.gguf", shape, mix("Q4_K_M"), default_model_path, embed_scale=1.0)
    stored = {
        t.name: (t.tensor_type.name, tuple(int(d) for d in t.shape)) for t in GGUFReader(str(path)).tensors
    }
    assert stored["blk.0.ffn_gate_exps.weight"] == ("Q4_K", (256, 256, 4))
    assert stored["blk.0.ffn_down_exps.weight"] == ("Q4_K", (256, 256, 4))
    assert stored["blk.1.ffn_down_exps.weight"] == ("Q6_K", (256, 256, 4))  # llama.cpp's last layer
    assert stored["blk.1.ffn_gate_inp.weight"] == ("F32", (256, 4))
    checkpoint = load_checkpoint(path)
    weights = sum(int(np.prod(t.shape)) for t in GGUFReader(str(path)).tensors)
    assert checkpoint.spec.parameter_count() == weights  # the memory plan's count of an HF model's
    kept = {n: m.qtype.name for n, m in checkpoint.blocks.items() if ".experts." in n}
    assert len(kept) == 2 * 4 * 3
    assert kept["layers.0.experts.3.w_down"] == "Q4_K" and kept["layers.1.experts.3.w_down"] == "Q6_K"
    assert kept["layers.1.experts.0.w_up"] == "Q4_K"
    tokens = probe_tokens(checkpoint.spec.vocab_size, 12)
    dequantized, _, _ = numpy_forward(checkpoint, tokens)
    products, _, _ = numpy_forward(checkpoint, tokens, kernels=True)
    np.testing.assert_allclose(products, dequantized, rtol=0, atol=2e-4 * np.abs(dequantized).max())
    runner = ModelRunner.from_checkpoint(checkpoint, DEFAULT_RUNTIME)
    warm_up(runner, known=KnownAnswer.of_checkpoint(checkpoint, runner.runtime))


def test_the_served_stack_answers_as_transformers_over_http(tiny, tmp_path):
    """start_agent.py and start_server.py on the GGUF, as a user runs them (the agent's memory plan,
    warm-up and known-answer check included): /v1/completions of token prompts at temperature 0
    answers with transformers' greedy text, the 150-token prompt in chunks of 64."""
    from agent_harness import LONG_ANSWERS_RUNTIME, free_ports, serving_stack, write_config
    from http_client import greedy_completions

    model, paths = tiny
    cases = [prompts()[0], prompts()[1]]
    tokenizer = load_tokenizer(paths[1])
    want = [tokenizer.decode(answer) for answer in reference_answers(model, cases)]
    agent_port, http_port = free_ports(2)
    config = write_config(
        tmp_path, paths[1], [agent_port], runtime=LONG_ANSWERS_RUNTIME, server={"port": http_port}
    )
    with serving_stack(config):
        assert greedy_completions(f"http://127.0.0.1:{http_port}", cases, NEW_TOKENS) == want
