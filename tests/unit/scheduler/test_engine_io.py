"""The engine's boundary (scheduler/engine_io.py): a frozen request in, frozen outputs out, the
scheduler's Sequence never crossing it."""

from __future__ import annotations

import dataclasses

import pytest

from agent.contract.sampling import SamplingParams, TokenLogprob
from scheduler.engine_io import EngineOutput, EngineRequest, FaultKind, FinishReason
from scheduler.sequence import Sequence, SequenceStatus


def test_a_request_is_frozen_and_holds_a_validated_sampling():
    sampling = SamplingParams(temperature=0.5)
    request = EngineRequest(request_id="r", prompt=[1, 2, 3], sampling=sampling, max_new_tokens=8)  # type: ignore[arg-type]
    assert request.prompt == (1, 2, 3)  # a caller's list is not shared with the engine
    with pytest.raises(dataclasses.FrozenInstanceError):
        request.max_new_tokens = 9  # type: ignore[misc]
    with pytest.raises(TypeError, match="SamplingParams"):  # a raw dict never reaches the engine
        EngineRequest(request_id="r", prompt=(1,), sampling={"temperature": 0.5}, max_new_tokens=8)  # type: ignore[arg-type]


def test_the_stop_ids_are_eos_and_the_requests_own_unless_eos_is_ignored():
    sampling = SamplingParams(stop_token_ids=(7, 8))
    request = EngineRequest(request_id="r", prompt=(1,), sampling=sampling, max_new_tokens=4)
    assert request.stop_ids({0, 2}) == {0, 2, 7, 8}
    assert dataclasses.replace(request, ignore_eos=True).stop_ids({0, 2}) == {7, 8}


def test_a_sequence_reports_its_new_tokens_and_its_end_once():
    seq = Sequence("r", [1], SamplingParams(), 4)
    seq.output += [5, 6]
    seq.logprobs += [TokenLogprob(-0.1), TokenLogprob(-0.2)]
    first = seq.report()
    assert first == EngineOutput("r", (5, 6), tuple(seq.logprobs))
    assert not first.finished
    seq.output.append(7)
    seq.status, seq.finish_reason, seq.error = SequenceStatus.FINISHED, FinishReason.ERROR, "agent gone"
    last = seq.report()
    assert last is not None and last.new_token_ids == (7,) and last.finished
    assert (last.error, last.fault) == ("agent gone", FaultKind.UNAVAILABLE)
    assert seq.report() is None  # its end goes out once
    with pytest.raises(dataclasses.FrozenInstanceError):
        last.error = None  # type: ignore[misc]
