"""The step's second-tier fields (agent/contract/step.py `spill`, `restore`; step_reply.py
`restore_failed`, `tier`): they go to the wire and back unchanged, and a malformed one from a peer is
refused with a message naming the field, before anything runs."""

from __future__ import annotations

import pytest

from agent.contract import protocol
from agent.contract.step import StepChunk, StepRequest
from agent.contract.step_reply import MAX_REPORTED_EVICTIONS, TIER_COUNTS, StepReply, TierReport

A, B = "a" * 64, "0123456789abcdef" * 4
CHUNK = StepChunk(0, [5, 6, 7], [3], 0)


def over_wire(request: StepRequest, extra: dict | None = None) -> StepRequest:
    fields, arrays = request.to_wire()
    header, out = protocol.decode(protocol.encode({"op": "step", "id": 1, **fields, **(extra or {})}, arrays))
    return StepRequest.from_wire(header, out, 4)


def test_spill_and_restore_round_trip():
    request = StepRequest(chunks=[CHUNK], spill=[(3, A), (4, B)], restore=[(B, 7)])
    got = over_wire(request)
    assert got.spill == [(3, A), (4, B)] and got.restore == [(B, 7)]
    plain = over_wire(StepRequest(chunks=[CHUNK]))
    assert plain.spill == [] and plain.restore == []
    assert "spill" not in StepRequest(chunks=[CHUNK]).to_wire()[0]  # absent unless used


@pytest.mark.parametrize(
    "extra",
    [
        {"spill": [[3, "A" * 64]]},  # upper case: not a digest this side names
        {"spill": [[3, "ab"]]},
        {"spill": [[A, 3]]},  # the pair the wrong way round
        {"restore": [[A, -1]]},
        {"restore": [[A, True]]},
        {"restore": [A, 3]},
        {"restore": {"a": 1}},
    ],
)
def test_a_malformed_tier_field_is_refused(extra):
    with pytest.raises(ValueError, match="spill|restore"):
        over_wire(StepRequest(chunks=[CHUNK]), extra)


def reply_over_wire(reply: StepReply, request: StepRequest, extra: dict | None = None) -> StepReply:
    fields, arrays = reply.to_wire()
    header, out = protocol.decode(
        protocol.encode({"op": "step", "id": 1, "ok": True, **fields, **(extra or {})}, arrays)
    )
    return StepReply.from_wire(header, out, request, 50)


def test_restore_failed_round_trips_and_names_only_what_was_restored():
    request = StepRequest(chunks=[CHUNK], restore=[(A, 1), (B, 2)])
    reply = StepReply([], [None], restore_failed=(B,))
    assert reply_over_wire(reply, request) == reply
    assert reply_over_wire(StepReply([], [None]), request).restore_failed == ()
    with pytest.raises(ValueError, match="restore_failed"):
        reply_over_wire(StepReply([], [None]), request, {"restore_failed": ["c" * 64]})
    with pytest.raises(ValueError, match="restore_failed"):
        reply_over_wire(StepReply([], [None]), request, {"restore_failed": [[A]]})


def test_the_tier_report_round_trips_and_a_malformed_one_is_refused():
    request = StepRequest(chunks=[CHUNK], restore=[(A, 1)])
    counts = {name: i for i, name in enumerate(TIER_COUNTS)}
    reply = StepReply([], [None], tier=TierReport(counts, 4096, 1 << 40, 0.0125))
    assert reply_over_wire(reply, request) == reply
    assert reply_over_wire(StepReply([], [None]), request).tier is None
    # counts a report leaves out are zero (an agent reports what it knows)
    partial = {"counts": {"host_hits": 2}, "host_bytes": 0, "disk_bytes": 0, "restore_ms": 1}
    got = reply_over_wire(StepReply([], [None]), request, {"tier": partial}).tier
    assert got is not None and got.counts == {name: 2 * (name == "host_hits") for name in TIER_COUNTS}
    for bad in (
        {**partial, "counts": {"host_hits": -1}},
        {**partial, "counts": {"stolen": 1}},
        {**partial, "counts": {"host_hits": True}},
        {**partial, "host_bytes": 1.5},
        {**partial, "disk_bytes": None},
        {**partial, "restore_ms": float("nan")},
        {**partial, "restore_ms": -1},
        [1, 2],
    ):
        with pytest.raises(ValueError, match="tier"):
            reply_over_wire(StepReply([], [None]), request, {"tier": bad})


def test_the_keys_a_tier_let_go_round_trip_and_a_malformed_list_is_refused():
    request = StepRequest(chunks=[CHUNK], spill=[(1, A)])
    counts = dict.fromkeys(TIER_COUNTS, 0)
    reply = StepReply([], [None], tier=TierReport(counts, 0, 0, 0.0, (A, B)))
    assert reply_over_wire(reply, request).tier == TierReport(counts, 0, 0, 0.0, (A, B))
    partial = {"counts": {}, "host_bytes": 0, "disk_bytes": 0, "restore_ms": 0}
    got = reply_over_wire(StepReply([], [None]), request, {"tier": partial}).tier
    assert got is not None and got.evicted_keys == ()
    for bad in ([A] * (MAX_REPORTED_EVICTIONS + 1), [3], [""], ["a" * 129], A):
        with pytest.raises(ValueError, match="tier"):
            reply_over_wire(StepReply([], [None]), request, {"tier": {**partial, "evicted_keys": bad}})
