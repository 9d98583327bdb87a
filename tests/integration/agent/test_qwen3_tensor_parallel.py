"""The Qwen3 family off the fused kernel: Qwen3's layers (QK-norm: each query and key head RMS-normed
before RoPE; a head size that is not hidden / heads) and Qwen3-MoE's (the same attention, then routed
experts), op by op in one process (MindSpore's ops, the CPU kernels' norm and RoPE, or the paged
backend) and split over a tensor-parallel group of two real agents: each rank norms its own heads
with the same weights and holds its share of every expert's FFN columns, the router whole. The
reference is transformers' tiny models (tests/support/hf_reference.py, hf_moe_reference.py): their
greedy answers, logits and answers' logprobs, within float32's differences."""

import numpy as np
import pytest
from conftest import DEFAULT_RUNTIME
from test_qwen3moe_reference import prompts as moe_prompts
from test_transformers_reference import NEAR_TIE, NEW_TOKENS, prompts

import hf_moe_reference as hf_moe
import hf_reference as hf
import runner_calls as calls
from agent.contract.sampling import SamplingParams
from agent.graphs.interface import bucket
from agent.graphs.moe import MindSporeExperts
from agent.model.checkpoint import cut
from agent.model.formats import load_checkpoint
from agent.model.shard import LayerShare, TensorSplit
from agent.model.tokenizer import load_tokenizer
from agent.runner import ModelRunner
from agent_harness import free_ports, serving_stack, write_config
from http_client import post

TOLERANCE = 1e-3  # |logit| and |logprob| differences: float32 sums in another order (about 1e-5)
OP_BY_OP = {  # runtime settings of the op-by-op paths of one process
    "mindspore ops": {"matmul": "mindspore"},
    "cpu kernels": {"decode_attention": "gather"},
    "paged backend": {"decode_attention": "paged", "matmul": "mindspore"},  # Ascend's, in its reference
}


@pytest.fixture(scope="module", params=["qwen3", "qwen3moe"])
def family(request, tmp_path_factory):
    """transformers' tiny model (head size 32 beside hidden 64 / 4 heads; Qwen3-MoE's 8 experts of 64
    columns, 2 a token), its Hugging Face directory and GGUF, and its greedy answers to the prompts."""
    name = request.param
    directory = tmp_path_factory.mktemp(name)
    if name == "qwen3":
        model = hf.build(name, directory, seed=0)
        gguf = hf.write_gguf(directory, directory / "qwen3.gguf", name)
        cases = prompts(name)
    else:
        model = hf_moe.build(directory, seed=0)
        gguf, _ = hf_moe.write_gguf(directory, directory / "qwen3moe.gguf")
        cases = moe_prompts()
    answers = []
    for prompt in cases:
        answer, gap = hf.greedy(model, prompt, NEW_TOKENS)
        assert gap > NEAR_TIE, (len(prompt), gap)
        answers.append(answer)
    return {"name": name, "model": model, "paths": [directory, gguf], "cases": list(zip(cases, answers))}


def reference_logits(model, tokens: list[int]) -> np.ndarray:
    """transformers' logits [len(tokens), vocab] of one forward over the tokens."""
    import torch

    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0].numpy()


@pytest.mark.parametrize("settings", OP_BY_OP.values(), ids=OP_BY_OP.keys())
def test_op_by_op_layers_answer_as_transformers(family, settings):
    for path in family["paths"]:
        runtime = DEFAULT_RUNTIME.model_copy(update=settings)
        runner = ModelRunner.from_checkpoint(load_checkpoint(path), runtime)
        assert all(layer.kernel_layer is None for layer in runner.graphs.model.layers)
        if family["name"] == "qwen3moe":  # MindSpore's products: the experts in its ops, else the CPU op
            mindspore = settings.get("matmul") == "mindspore"
            assert all(
                isinstance(layer.moe, MindSporeExperts) == mindspore for layer in runner.graphs.model.layers
            )
        for prompt, want in family["cases"]:
            got = [calls.prefill(runner, 0, prompt, SamplingParams())]
            got += [calls.decode(runner, [0])[0] for _ in range(NEW_TOKENS - 1)]
            runner.release(0)
            assert got == want, (path.name, len(prompt))
        # the long prompt's last logits, not only their argmax
        prompt = family["cases"][1][0]
        graphs = runner.graphs
        length = bucket(DEFAULT_RUNTIME.prefill_buckets, len(prompt))
        logits = graphs.prefill(graphs.inputs.slot_table(0), np.asarray(prompt), length, 0).asnumpy()[0]
        want_logits = reference_logits(family["model"], prompt)[-1]
        assert np.abs(logits - want_logits).max() < TOLERANCE, path.name


def test_each_rank_holds_its_share_of_every_expert(family):
    """A rank's experts are the whole model's rows of gate/up and columns of down of its half of the
    expert FFN; the router and the QK-norm weights whole."""
    if family["name"] != "qwen3moe":
        pytest.skip("a dense model's shares: test_rank_shards.py")
    for path in family["paths"]:
        whole = load_checkpoint(path)
        for rank in range(2):
            share = load_checkpoint(path, split=TensorSplit(rank, 2))
            cuts = LayerShare.of(whole.spec, TensorSplit(rank, 2))
            assert cuts.expert_ffn == slice(32 * rank, 32 * (rank + 1))
            for e in (0, 7):
                for name, rows, columns in (("w_gate", 32, 64), ("w_up", 32, 64), ("w_down", 64, 32)):
                    tensor = f"layers.1.experts.{e}.{name}"
                    want = cut(whole.matrix(tensor), *cuts.cut(tensor))
                    assert share.matrix(tensor).shape == want.shape == (rows, columns), tensor
                    assert np.array_equal(share.matrix(tensor), want), tensor
            for tensor in ("layers.1.router", "layers.1.q_norm", "layers.1.k_norm"):
                assert np.array_equal(share.matrix(tensor), whole.matrix(tensor)), tensor


@pytest.fixture(scope="module")
def group(family, tmp_path_factory):
    """The family's GGUF (its vocabulary inside) served by one group of two agents."""
    ports = free_ports(4)
    path = write_config(
        tmp_path_factory.mktemp(f"{family['name']}-tensor-parallel"),
        family["paths"][1],
        ports[:2],
        runtime=DEFAULT_RUNTIME.model_dump(mode="json"),
        model={"name": family["name"]},
        agents={"ports": ports[:2], "groups": [{"ports": ports[:2], "cluster_port": ports[2]}]},
        server={"port": ports[3]},
    )
    with serving_stack(path) as (agents, server):
        yield {"base": f"http://127.0.0.1:{ports[3]}", "logs": path.parent / "logs"}


def test_two_ranks_answer_as_transformers(family, group):
    """Each rank holds one KV head with its two query heads and half the FFN columns (of every
    expert); the group's greedy answers are transformers' (and so one process's, above), each token's
    logprob within float32's differences of transformers' log-softmax."""
    tokenizer = load_tokenizer(family["paths"][1])
    for prompt, want in family["cases"]:
        response = post(
            f"{group['base']}/v1/completions",
            {
                "model": family["name"],
                "prompt": prompt,
                "max_tokens": NEW_TOKENS,
                "temperature": 0,
                "ignore_eos": True,
                "logprobs": 0,
            },
        )
        assert response.status_code == 200, response.text
        choice = response.json()["choices"][0]
        # The server never sends half a UTF-8 character: a cut-off one at the end is dropped.
        assert choice["text"] == tokenizer.decode(want).rstrip("\ufffd"), len(prompt)
        logits = reference_logits(family["model"], prompt + want)[len(prompt) - 1 : -1]
        shifted = logits - logits.max(-1, keepdims=True)
        log_softmax = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
        want_logprobs = log_softmax[np.arange(NEW_TOKENS), want]
        got_logprobs = np.array(choice["logprobs"]["token_logprobs"], np.float64)
        assert np.abs(got_logprobs - want_logprobs).max() < TOLERANCE, len(prompt)
    logs = group["logs"]
    assert "rank 0 of 2: KV heads 0..0" in (logs / "agent_0.log").read_text()
    assert "rank 1 of 2: KV heads 1..1" in (logs / "agent_1.log").read_text()
