"""AgentService's verified steps (speculative decoding) on the tiny model: the reply's logprobs and
errors hold one entry per token whether or not each slot's request asked for logprobs, and a slot
whose logprobs cannot be paired with its tokens (a bug) ends alone, logged."""

import logging

import numpy as np
import pytest

import runner_calls as calls
from agent.contract import protocol
from agent.contract.sampling import SamplingParams
from agent.service import AgentService

SESSION = 3
PLAIN, WITH_LOGPROBS = SamplingParams(), SamplingParams(logprobs=1)
PROMPTS = [[3, 4, 5, 6, 7], [9, 8, 7, 6, 5, 4]]


def table(slot: int) -> list[int]:
    return list(range(slot * 4, slot * 4 + 4))  # 4 blocks of 16: max_seq_len 64


def step(service: AgentService, drafts: dict[int, list[int]]) -> tuple[dict, list[int]]:
    """A step that decodes slots 0 and 1 with these proposals (4 rows of logits: the most there are)."""
    slots = [0, 1]
    frames = protocol.encode(
        {
            "op": "step",
            "id": 1,
            "session": SESSION,
            "chunks": [],
            "drafts": [[s, t] for s, t in drafts.items()],
        },
        [np.asarray(slots, np.int32), np.asarray([table(s) for s in slots], np.int32)],
    )
    header, arrays = protocol.decode(service.handle(frames))
    assert header["ok"], header
    return header, arrays[0].tolist()


@pytest.fixture
def service(tiny_llama_runner, release_all) -> AgentService:
    """An agent service whose slots 0 (no logprobs) and 1 (logprobs) have their prompts, and the
    greedy tokens each decodes next (what a proposal must be to be kept)."""
    release_all(tiny_llama_runner)
    service = AgentService(tiny_llama_runner, model_name="tiny", rank=0, port=0)
    service.handle(protocol.encode({"op": "reset", "id": 0, "session": SESSION}))
    return service


def answers(runner, n: int) -> list[list[int]]:
    """Each slot's first n greedy tokens, decoded one a step; the slots are then taken afresh."""
    tokens = [
        [calls.prefill(runner, s, PROMPTS[s], params, table(s))]
        for s, params in enumerate((PLAIN, WITH_LOGPROBS))
    ]
    for _ in range(n - 1):
        for s, token in enumerate(calls.decode(runner, [0, 1], [table(0), table(1)])):
            tokens[s].append(token)
    for s, params in enumerate((PLAIN, WITH_LOGPROBS)):
        runner.release(s)
        assert calls.prefill(runner, s, PROMPTS[s], params, table(s)) == tokens[s][0]
    return tokens


def test_a_verified_step_lists_a_logprob_or_null_for_every_token(service, tiny_llama_runner):
    """Slot 0 (no logprobs) keeps its 2 proposals beside slot 1 (logprobs): the reply listed slot
    1's logprob and none for slot 0's 3 tokens, a list shorter than the tokens, which the server
    took for a broken agent (every sequence of the group failed)."""
    want = answers(tiny_llama_runner, 4)
    header, tokens = step(service, {0: want[0][1:3]})
    assert header["counts"] == [3, 1] and tokens == want[0][1:4] + want[1][1:2]
    logprobs = header["logprobs"]
    assert len(logprobs) == len(tokens) and logprobs[:3] == [None] * 3 and logprobs[3] is not None
    assert "errors" not in header
    header, tokens = step(service, {1: want[1][2:4]})  # and the other way round
    assert header["counts"] == [1, 3] and len(header["logprobs"]) == 4 and header["logprobs"][0] is None


def test_logprobs_that_do_not_pair_with_a_slots_tokens_end_that_sequence_alone(
    service, tiny_llama_runner, monkeypatch, caplog
):
    """A fault nothing from outside can cause (a patch loses one of slot 1's logprobs): slot 1's
    tokens come with an internal error, slot 0's token with none, every list of the reply has an
    entry per token, and the agent's log says what happened."""
    want = answers(tiny_llama_runner, 4)
    recent = tiny_llama_runner.slot_table.recent_logprobs
    monkeypatch.setattr(tiny_llama_runner.slot_table, "recent_logprobs", lambda slot: recent(slot)[:-1])
    with caplog.at_level(logging.ERROR, logger="agent.slots"):
        header, tokens = step(service, {1: want[1][1:3]})
    assert header["counts"] == [1, 3] and tokens[0] == want[0][1]
    assert "logprobs" not in header  # slot 1's were lost, slot 0 asked none
    assert len(header["errors"]) == 4 and header["errors"][0] is None
    assert all(e is not None and e[0] == "internal" for e in header["errors"][1:])
    assert "slot 1: 2 logprobs for 3 verified tokens" in caplog.text
