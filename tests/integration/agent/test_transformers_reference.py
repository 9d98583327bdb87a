"""The dense families against Hugging Face `transformers`, their reference implementation (the
`reference` extra): a tiny model of each built by transformers with random float32 weights and the
family's real vocabulary (Llama 3's llama-bpe, Mistral's llama-spm, Qwen3's qwen2, Phi-3's phi-3;
SmolLM3's four layers, the last rotating nothing, on llama-bpe; Gemma 3's directory (two local
layers and a global one, four norms a layer) on llama-spm; Qwen3.5's three Gated DeltaNet
layers and a gated attention layer on qwen35, more value heads than key heads, dense and with
Qwen3.5-MoE's routed and shared experts in every layer), served from its Hugging Face
directory, from the GGUF llama.cpp's converter would write, and (Qwen3.5's) as the language model of
a multimodal checkpoint, as Qwen3.5 is published: greedy answers equal transformers'
`generate` for every prompt, one past 128 tokens and others from the vocabulary's own test texts.
The seed is fixed and its answers are no near-ties: transformers' best two logits differ by more
than NEAR_TIE at every step, far above float32's differences between the two (1e-5)."""

from pathlib import Path

import numpy as np
import pytest
from conftest import DEFAULT_RUNTIME

import hf_reference as hf
import runner_calls as calls
from agent.contract import protocol
from agent.contract.sampling import SamplingParams
from agent.kv_transfer import export_kv, import_kv, state_shapes
from agent.model.formats import load_checkpoint
from agent.model.tokenizer import load_tokenizer
from agent.runner import ModelRunner, RunnerError
from agent.service import AgentService

NEW_TOKENS = 12
NEAR_TIE = 1e-3
SUITE_TEXTS = (5, 20, 33)  # of each vocabulary's .inp file (non-blank ones)


@pytest.fixture(scope="module", params=list(hf.FAMILIES))
def family_files(request, tmp_path_factory) -> tuple[str, object, list[Path]]:
    """The family's transformers model, and its files: the Hugging Face directory, the GGUF."""
    family = request.param
    directory = tmp_path_factory.mktemp(family)
    model = hf.build(family, directory, seed=0)
    paths = [directory]
    if hf.FAMILIES[family].gguf_arch:
        paths.append(hf.write_gguf(directory, directory / f"{family}.gguf", family))
    if hf.FAMILIES[family].multimodal:
        paths.append(hf.write_multimodal(directory, directory / "multimodal", family))
    return family, model, paths


def prompts(family: str) -> list[list[int]]:
    tokenizer = load_tokenizer(hf.vocabulary_path(family))
    texts = hf.suite_texts(family)
    long = tokenizer.encode(" ".join(texts))[:150]
    assert len(long) == 150
    suite = [tokenizer.encode(texts[i]) for i in SUITE_TEXTS]
    return [tokenizer.encode("The capital of France is"), long, *suite]


def test_greedy_answers_equal_transformers(family_files):
    family, model, paths = family_files
    cases = prompts(family)
    answers = []
    for prompt in cases:
        answer, gap = hf.greedy(model, prompt, NEW_TOKENS)
        assert gap > NEAR_TIE, (family, len(prompt), gap)
        answers.append(answer)
    for path in paths:
        runner = ModelRunner.from_checkpoint(load_checkpoint(path), DEFAULT_RUNTIME)
        # every layer one fused kernel (a MoE model's: its attention or DeltaNet, then its experts)
        assert all(layer.kernel_layer is not None for layer in runner.graphs.model.layers)
        for prompt, want in zip(cases, answers):
            got = [calls.prefill(runner, 0, prompt, SamplingParams())]
            got += [calls.decode(runner, [0])[0] for _ in range(NEW_TOKENS - 1)]
            runner.release(0)
            assert got == want, (family, path.name, len(prompt))


def test_chunks_a_prefix_cache_hit_and_speculation_give_the_same_answer(family_files):
    """The prompt past 128 tokens in three chunks, then decoded by speculative steps (proposals of
    transformers' own answer, every other one with a wrong second token: right ones kept, the wrong
    one's position written over, a Gated DeltaNet state held and replayed); and a second slot
    starting from the first's 128 cached positions (a prefix-cache hit, from the state the second
    chunk saved where the model has Gated DeltaNet layers; not where sliding-window layers keep each
    slot's ring): transformers' greedy answer each time."""
    family, model, paths = family_files
    prompt = prompts(family)[1]
    want, _ = hf.greedy(model, prompt, NEW_TOKENS)
    for path in paths:
        runner = ModelRunner.from_checkpoint(load_checkpoint(path), DEFAULT_RUNTIME)
        hybrid = runner.spec.linear_attention is not None
        first = runner.graphs.inputs.slot_table(0)
        calls.prefill_chunk(runner, 0, prompt[:64], first)
        calls.prefill_chunk(runner, 0, prompt[:128], first, start=64, save=0 if hybrid else None)
        got, gave = [calls.prefill(runner, 0, prompt, SamplingParams(), first, start=128)], []
        while len(got) < NEW_TOKENS - 3:
            right = want[len(got) : len(got) + 3]
            proposals = right if len(gave) % 2 == 0 else [right[0], (right[1] + 1) % runner.spec.vocab_size]
            decoded, _ = calls.step(runner, [0], [first], [], drafts={0: proposals})
            got += decoded[0]
            gave.append(len(decoded[0]))
        assert got == want[: len(got)] and gave[:2] == [4, 2], (family, path.name, gave)
        if not runner.prefix_caching:  # sliding-window layers' rings
            assert family in ("mistral", "gemma3")
            continue
        second = runner.graphs.inputs.slot_table(1)
        shared = 128 // DEFAULT_RUNTIME.block_size
        second[:shared] = first[:shared]
        got = [
            calls.prefill(
                runner, 1, prompt, SamplingParams(), second, start=128, restore=0 if hybrid else None
            )
        ]
        got += [calls.decode(runner, [1], [second])[0] for _ in range(NEW_TOKENS - 1)]
        assert got == want, (family, path.name)


def test_a_hybrid_prompt_moved_to_another_runner_decodes_transformers_answer(family_files):
    """PD disaggregation of a model with Gated DeltaNet layers: the prompt prefilled on one runner,
    its K/V and its states moved to another runner's slot (as a decode agent receives them), which
    then decodes transformers' answer; the same K/V with the states left out does not."""
    family, model, paths = family_files
    if "linear_attention" not in hf.FAMILIES[family].config.get("layer_types", []):
        pytest.skip("a model without Gated DeltaNet layers moves K/V alone (test_kv_transfer.py)")
    prompt = prompts(family)[1]
    want, _ = hf.greedy(model, prompt, NEW_TOKENS)
    sender = ModelRunner.from_checkpoint(load_checkpoint(paths[-1]), DEFAULT_RUNTIME)
    receiver = ModelRunner.from_checkpoint(load_checkpoint(paths[-1]), DEFAULT_RUNTIME)
    first = calls.prefill(sender, 0, prompt, SamplingParams())
    blocks, states, state = export_kv(sender, 0)
    assert [s.shape for s in states] == state_shapes(receiver) and all(np.abs(s).max() > 0 for s in states)
    for slot, moved in ((2, states), (3, [np.zeros_like(s) for s in states])):
        table = receiver.graphs.inputs.slot_table(slot)
        import_kv(receiver, slot, blocks, state, table, moved)
        got = [first] + [calls.decode(receiver, [slot], [table])[0] for _ in range(NEW_TOKENS - 1)]
        receiver.release(slot)
        assert (got == want) == (slot == 2), (family, got, want)
    with pytest.raises(RunnerError, match="Gated DeltaNet states"):
        import_kv(receiver, 1, blocks, state, receiver.graphs.inputs.slot_table(1), states[:1])
    # over a decode agent's port: the states after the table, each checked before the slot is taken
    service = AgentService(receiver, model_name="tiny", rank=0, port=0, role="decode")
    service.handle(protocol.encode({"op": "reset", "id": 0, "session": 7}))
    table = receiver.graphs.inputs.slot_table(1)
    fields = {"op": "kv_receive", "id": 1, "session": 7, "slot": 1, "state": state}
    wrong = [states[0], states[1][:, :-1]]
    for ticket, arrays, error in ((1, [], "2 Gated DeltaNet state arrays"), (2, wrong, "do not fit")):
        header, _ = protocol.decode(
            service.handle(protocol.encode({**fields, "ticket": ticket}, [blocks, table, *arrays]))
        )
        assert not header["ok"] and error in header["error"] and 1 not in receiver.slots
    header, _ = protocol.decode(
        service.handle(protocol.encode({**fields, "ticket": 3}, [blocks, table, *states]))
    )
    assert header["ok"] and receiver.slot_table.slot_length(1) == len(prompt)
