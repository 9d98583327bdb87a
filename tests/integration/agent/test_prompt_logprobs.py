"""Prompt logprobs on the tiny model's runner (agent/contract/prompt_logprobs.py): a prompt's
scores equal the logprobs its greedy generation reported for the same tokens; a prompt computed in
chunks (each scoring its last row at the next chunk's first token) scores as one computed whole;
the wire carries them (StepReply's chunk_prompt_logprobs); a mixed step refuses such a chunk."""

import numpy as np
import pytest

import runner_calls as calls
from agent.contract import protocol
from agent.contract.sampling import SamplingParams
from agent.contract.step import StepChunk, StepRequest
from agent.contract.step_reply import StepReply
from agent.runner import RunnerError
from agent.service import AgentService

PROMPT = [3, 4, 5, 6, 7, 11, 2, 9]
GREEDY = SamplingParams(logprobs=3)
SESSION = 5


def table(slot: int) -> list[int]:
    return list(range(slot * 4, slot * 4 + 4))  # 4 blocks of 16: max_seq_len 64


def greedy(runner, n: int) -> tuple[list[int], list]:
    """The prompt's first n greedy tokens with their logprobs (slot 0, released after)."""
    (first,) = runner.execute(StepRequest(chunks=[StepChunk(0, PROMPT, table(0), 0, GREEDY)])).firsts
    sampled = [first]
    for _ in range(n - 1):
        sampled += runner.execute(StepRequest(slots=[0], tables=[table(0)])).decoded[0]
    runner.release(0)
    return [s.token for s in sampled], [s.logprob for s in sampled]


def scored(runner, tokens: list[int], k: int, slot: int = 1) -> list:
    """The prompt logprobs of `tokens` computed as one chunk."""
    chunk = StepChunk(slot, tokens, table(slot), 0, GREEDY, prompt_logprobs=k)
    (scores,) = runner.execute(StepRequest(chunks=[chunk])).prompts
    runner.release(slot)
    return scores


def test_prompt_scores_equal_greedy_logprobs(tiny_llama_runner, release_all):
    release_all(tiny_llama_runner)
    runner = tiny_llama_runner
    tokens, logprobs = greedy(runner, 6)
    whole = PROMPT + tokens[:-1]
    scores = scored(runner, whole, 3)
    assert len(scores) == len(whole) - 1
    for entry, generated in zip(scores[len(PROMPT) - 1 :], logprobs[:-1]):
        assert entry.logprob == pytest.approx(generated.logprob, abs=1e-3)
        assert entry.rank == 1  # greedy: the most likely token
        assert [t for t, _ in entry.top] == [t for t, _ in generated.top]
        assert np.allclose([v for _, v in entry.top], [v for _, v in generated.top], atol=1e-3)
    for position, entry in enumerate(scores, start=1):  # the token's value is among the top where ranked
        assert entry.logprob <= entry.top[0][1] + 1e-9
        if entry.rank <= 3:
            assert entry.top[entry.rank - 1] == (whole[position], pytest.approx(entry.logprob))


def test_chunked_prompt_scores_as_whole(tiny_llama_runner, release_all):
    release_all(tiny_llama_runner)
    runner = tiny_llama_runner
    if not runner.chunked_prefill:
        pytest.skip("these graphs compute no chunks")
    prompt = [int(t) for t in np.random.default_rng(3).integers(1, runner.spec.vocab_size, 40)]
    whole = scored(runner, prompt, 2)
    pieces = []
    for start, end in ((0, 13), (13, 29)):
        chunk = StepChunk(1, prompt[:end], table(1), start, prompt_logprobs=2, lookahead=prompt[end])
        assert chunk.scores == end - start
        pieces += runner.execute(StepRequest(chunks=[chunk])).prompts[0]
    last = StepChunk(1, prompt, table(1), 29, GREEDY, prompt_logprobs=2)
    pieces += runner.execute(StepRequest(chunks=[last])).prompts[0]
    runner.release(1)
    assert len(pieces) == len(whole) == len(prompt) - 1
    for a, b in zip(pieces, whole):
        assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
        assert a.rank == b.rank
        assert [t for t, _ in a.top] == [t for t, _ in b.top]


def test_scores_cross_the_wire(tiny_llama_runner, release_all):
    release_all(tiny_llama_runner)
    service = AgentService(tiny_llama_runner, model_name="tiny", rank=0, port=0)
    service.handle(protocol.encode({"op": "reset", "id": 0, "session": SESSION}))
    request = StepRequest(chunks=[StepChunk(2, PROMPT, table(2), 0, GREEDY, prompt_logprobs=4)])
    fields, arrays = request.to_wire()
    header, out = protocol.decode(
        service.handle(protocol.encode({"op": "step", "id": 1, "session": SESSION, **fields}, arrays))
    )
    assert header["ok"], header
    reply = StepReply.from_wire(header, out, request, tiny_llama_runner.spec.vocab_size)
    assert reply.prompts[0] is not None and len(reply.prompts[0]) == len(PROMPT) - 1
    assert all(len(e.top) == 4 for e in reply.prompts[0])
    assert reply.prompts[0] == scored(tiny_llama_runner, PROMPT, 4, slot=3)
    # a reply that lost them does not fit its request
    header.pop("chunk_prompt_logprobs")
    with pytest.raises(ValueError, match="prompt logprobs"):
        StepReply.from_wire(header, out, request, tiny_llama_runner.spec.vocab_size)
    tiny_llama_runner.release(2)


def test_mixed_step_refuses_scoring_chunk(tiny_llama_runner, release_all):
    release_all(tiny_llama_runner)
    runner = tiny_llama_runner
    if not runner.mixed_rows:
        pytest.skip("these graphs run no mixed steps")
    calls.prefill(runner, 0, PROMPT, GREEDY, table(0))
    with pytest.raises(RunnerError, match="runs alone"):
        calls.step(runner, [0], [table(0)], [StepChunk(1, PROMPT, table(1), 0, GREEDY, prompt_logprobs=1)])
    runner.release(0)
