"""The agent step's typed request and reply (agent/contract/step.py, step_reply.py): each goes to
the wire and back unchanged through protocol.encode/decode, and a malformed one from a peer is
refused with a message naming what is wrong, before anything runs."""

from __future__ import annotations

import numpy as np
import pytest
from pydantic import ValidationError

from agent.contract import protocol
from agent.contract.sampling import NO_TOKEN, Sampled, SamplingParams, SequenceFault, TokenLogprob
from agent.contract.step import KVTransfer, StepChunk, StepLimits, StepRequest
from agent.contract.step_reply import StepReply

VOCAB = 50
MASK = np.array([0b1010, 0], np.int32)


def over_wire(request: StepRequest, max_chunks: int = 4) -> StepRequest:
    fields, arrays = request.to_wire()
    header, out = protocol.decode(protocol.encode({"op": "step", "id": 1, **fields}, arrays))
    return StepRequest.from_wire(header, out, max_chunks)


def reply_over_wire(reply: StepReply, request: StepRequest) -> StepReply:
    fields, arrays = reply.to_wire()
    header, out = protocol.decode(protocol.encode({"op": "step", "id": 1, "ok": True, **fields}, arrays))
    return StepReply.from_wire(header, out, request, VOCAB)


def test_a_mixed_step_request_round_trips():
    chunks = [
        StepChunk(2, [5, 6, 7, 8], [3, 4], 2, SamplingParams(temperature=0.5, top_k=3)),
        StepChunk(3, [9, 10], [5], 0),
    ]
    request = StepRequest([0, 1], [[0], [1, 2]], chunks, {0: MASK}, {1: [4, 5], 0: 3})
    got = over_wire(request)
    assert got.slots == [0, 1] and got.drafts == {1: [4, 5], 0: 3} and got.transfer is None
    assert [t.tolist() for t in got.tables] == [[0, -1], [1, 2]]  # padded with -1 to one width
    assert [(c.slot, list(c.tokens), c.table.tolist(), c.start, c.sampling) for c in got.chunks] == [
        (c.slot, c.tokens, c.table, c.start, c.sampling) for c in chunks
    ]
    assert list(got.masks) == [0] and got.masks[0].tolist() == MASK.tolist()
    assert got.kind == "mixed"


def test_a_decode_alone_and_a_prefill_with_its_kv_transfer_round_trip():
    decode = over_wire(StepRequest([2], [[7]]))
    assert decode.kind == "decode" and decode.slots == [2] and decode.chunks == []
    transfer = KVTransfer("tcp://10.0.0.2:7001", 1, 99, 12, (4, 5))
    prefill = StepRequest(chunks=[StepChunk(0, [1, 2, 3], [0], 0, SamplingParams())], transfer=transfer)
    got = over_wire(prefill)
    assert got.kind == "prefill" and got.transfer == transfer
    assert got.transfer.receive_fields({"length": 3}) == {
        "slot": 1,
        "session": 99,
        "ticket": 12,
        "state": {"length": 3},
    }


def wire(request: StepRequest, **changes) -> tuple[dict, list[np.ndarray]]:
    fields, arrays = request.to_wire()
    fields = {**fields, **changes}
    return {k: v for k, v in fields.items() if v is not None}, arrays


SAMPLING = StepChunk(0, [1, 2], [0], 0, SamplingParams())
TRANSFER = KVTransfer("tcp://h:1", 1, 2, 3, (0,))


@pytest.mark.parametrize(
    "header, arrays, message",
    [
        ({"chunks": "x"}, [], "list of up to 4 chunks"),
        ({"chunks": [{}] * 5}, [], "list of up to 4 chunks"),
        ({"chunks": []}, [np.array([0], np.int32)], "decode slot ids"),
        ({"chunks": []}, [np.array([0], np.int32), np.zeros((2, 1), np.int32)], "decodes 1 slots with 2"),
        ({"chunks": []}, [np.zeros(0, np.int32), np.zeros((0, 0), np.int32)], "decodes slots, computes"),
        (*wire(StepRequest([0], [[0]]), drafts=[[0, "a"]]), "'drafts' must list"),
        (*wire(StepRequest([0], [[0]]), drafts=[[0, 2], [0, 3]]), "names a slot twice"),
        (*wire(StepRequest([0], [[0]]), masked=[0, 0]), "distinct slot ids"),
        (*wire(StepRequest([0], [[0]]), masked=[0, 1]), "token masks: an int32 array"),
        (
            *wire(StepRequest(chunks=[SAMPLING]), chunks=[{"slot": 0, "start": 0, "sample": "yes"}]),
            r"sample \(true or false\)",
        ),
        (
            *wire(StepRequest(chunks=[SAMPLING]), chunks=[{"slot": 0.5, "start": 0, "sample": False}]),
            "integers",
        ),
        (
            *wire(
                StepRequest(chunks=[SAMPLING]),
                chunks=[{"slot": 0, "start": 0, "sample": False, "sampling": {}}],
            ),
            "only then",
        ),
        (*wire(StepRequest(chunks=[SAMPLING]), transfer="x"), "transfer must be a map"),
        (
            *wire(StepRequest(chunks=[SAMPLING]), transfer={**TRANSFER.to_wire(), "address": 5}),
            "transfer.address",
        ),
        (
            *wire(StepRequest(chunks=[SAMPLING]), transfer={**TRANSFER.to_wire(), "table": [1, -2]}),
            "transfer.table",
        ),
        (
            *wire(StepRequest(chunks=[SAMPLING]), transfer={**TRANSFER.to_wire(), "ticket": True}),
            "transfer.ticket",
        ),
        (*wire(StepRequest([1], [[1]], [SAMPLING]), transfer=TRANSFER.to_wire()), "one whole prompt alone"),
        (
            *wire(StepRequest(chunks=[StepChunk(0, [1], [0], 0)]), transfer=TRANSFER.to_wire()),
            "one whole prompt",
        ),
    ],
)
def test_a_malformed_step_request_is_refused(header, arrays, message):
    with pytest.raises(ValueError, match=message):
        StepRequest.from_wire(header, arrays, 4)


def test_a_chunk_array_that_is_not_integers_is_refused():
    fields, arrays = StepRequest(chunks=[SAMPLING]).to_wire()
    arrays[2] = arrays[2].astype(np.float32)
    with pytest.raises(ValueError, match="1-D integer arrays: token ids, block table"):
        StepRequest.from_wire(fields, arrays, 4)
    fields["chunks"][0]["sampling"] = {"top_p": 7}
    with pytest.raises(ValidationError, match="top_p"):
        StepRequest.from_wire(fields, StepRequest(chunks=[SAMPLING]).to_wire()[1], 4)


def test_a_step_reply_round_trips_with_its_logprobs_faults_and_transfer():
    logprob = TokenLogprob(-0.5, ((7, -0.5), (8, -1.5)))
    fault = SequenceFault("request", "nothing to sample")
    request = StepRequest(
        [0, 1],
        [[0], [1]],
        [StepChunk(2, [1], [2], 0), StepChunk(3, [1], [3], 0, SamplingParams())],
        {},
        {0: [7, 9]},
    )
    reply = StepReply(
        [[Sampled(7, logprob), Sampled(4)], [Sampled(NO_TOKEN, None, fault)]], [None, Sampled(5)]
    )
    assert reply_over_wire(reply, request) == reply
    plain = StepReply([[Sampled(3)], [Sampled(4)]], [None, Sampled(5)])
    assert reply_over_wire(plain, request) == plain
    sent = StepReply([], [Sampled(6)], kv_bytes=4096, transfer_ms=1.5)
    assert reply_over_wire(sent, StepRequest(chunks=[SAMPLING], transfer=TRANSFER)) == sent


@pytest.mark.parametrize(
    "change, message",
    [
        ({"counts": [2]}, "counts do not fit"),  # more tokens than proposals and one
        ({"counts": [1, 1]}, "counts do not fit"),
        ({"chunk_tokens": []}, "a token per sampling chunk"),
        ({"chunk_tokens": [None]}, "a token per sampling chunk"),
        ({"logprobs": [None, None]}, "logprobs do not fit"),
        ({"chunk_errors": "x"}, "chunk_errors do not fit"),
    ],
)
def test_a_step_reply_that_does_not_fit_its_request_is_refused(change, message):
    request = StepRequest([0], [[0]], [SAMPLING])
    fields, arrays = StepReply([[Sampled(3)]], [Sampled(4)]).to_wire()
    with pytest.raises(ValueError, match=message):
        StepReply.from_wire({**fields, **change}, arrays, request, VOCAB)


def test_a_bad_token_in_a_reply_is_its_sequences_fault_alone():
    request = StepRequest([0, 1], [[0], [1]])
    fields, _ = StepReply([[Sampled(1)], [Sampled(2)]], []).to_wire()
    got = StepReply.from_wire(fields, [np.array([VOCAB + 5, 2], np.int32)], request, VOCAB, "agent x")
    assert got.decoded[1] == [Sampled(2)]
    (bad,) = got.decoded[0]
    assert (
        bad.token == NO_TOKEN
        and bad.fault.kind == "internal"
        and bad.fault.message.startswith("agent x sent")
    )


def test_the_step_limits_are_one_rule_for_rows_sequences_and_logits():
    limits = StepLimits(mixed_rows=16, max_batch=4)
    assert limits.fits(2, 1, [10], 1)  # 13 rows, 3 sequences, 4 rows of logits
    assert "exceeds 16 rows" in limits.refusal(2, 1, [14], 1)
    assert not limits.fits(2, 0, [1, 1, 1], 0)  # 5 sequences
    assert not limits.fits(2, 2, [3], 1)  # 5 rows of logits
    assert limits.proposal_room(2) == 1 and limits.prompt_rows(2, 1) == 13


POOLING = [
    StepChunk(2, [1, 2], [2], 0, SamplingParams(pool="hidden")),
    StepChunk(3, [1], [3], 0, SamplingParams(pool=(4, 9))),
    StepChunk(4, [1], [4], 0, SamplingParams()),
]


def pooled_reply(*vectors) -> StepReply:
    return StepReply([], [Sampled(1), Sampled(2), Sampled(3)], pooled=list(vectors))


def test_pooled_vectors_round_trip_with_their_chunks():
    request = over_wire(StepRequest(chunks=POOLING))
    assert [c.sampling.pool for c in request.chunks] == ["hidden", (4, 9), None]
    hidden, labels = np.linspace(-1, 1, 6, dtype=np.float32), np.array([1.5, -2.0], np.float32)
    got = reply_over_wire(pooled_reply(hidden, labels, None), request)
    assert got.firsts == [Sampled(1), Sampled(2), Sampled(3)] and got.pooled[2] is None
    np.testing.assert_array_equal(got.pooled[0], hidden)
    np.testing.assert_array_equal(got.pooled[1], labels)
    # a pooling chunk whose token failed has no vector to send
    failed = StepReply([], [Sampled(NO_TOKEN, None, SequenceFault("internal", "x")), Sampled(2), None])
    request = StepRequest(chunks=[*POOLING[:2], StepChunk(4, [1], [4], 0)])
    failed = StepReply(failed.decoded, failed.firsts, pooled=[None, labels, None])
    assert reply_over_wire(failed, request).pooled[0] is None


@pytest.mark.parametrize(
    "vectors, message",
    [
        ((None, np.zeros(2, np.float32), None), "without a pooling chunk's vector"),
        ((np.zeros(6, np.float32), np.zeros(3, np.float32), None), "not the float32 vector"),
        ((np.full(6, np.nan, np.float32), np.zeros(2, np.float32), None), "not the float32 vector"),
        (
            (np.zeros(6, np.float32), np.zeros(2, np.float32), np.zeros(2, np.float32)),
            "not the float32 vector",
        ),
        ((np.zeros((2, 3), np.float32), np.zeros(2, np.float32), None), "not the float32 vector"),
    ],
)
def test_a_reply_without_its_pooled_vectors_or_with_bad_ones_is_refused(vectors, message):
    fields, arrays = pooled_reply(*vectors).to_wire()
    header, out = protocol.decode(protocol.encode({"op": "step", "id": 1, "ok": True, **fields}, arrays))
    with pytest.raises(ValueError, match=message):
        StepReply.from_wire(header, out, StepRequest(chunks=POOLING), VOCAB)


def test_a_reply_with_vectors_its_header_does_not_name_or_of_another_type_is_refused():
    fields, arrays = pooled_reply(np.zeros(6, np.float32), np.zeros(2, np.float32), None).to_wire()
    with pytest.raises(ValueError, match="not the float32 vector"):
        StepReply.from_wire(
            fields, [arrays[0], arrays[1].astype(np.float64), arrays[2]], StepRequest(chunks=POOLING), VOCAB
        )
    del fields["chunk_pooled"]
    with pytest.raises(ValueError, match="without the pooled vectors"):
        StepReply.from_wire(fields, arrays, StepRequest(chunks=POOLING), VOCAB)


@pytest.mark.parametrize("pool", ["max", (), (-1,), tuple(range(17)), [1.5]])
def test_a_pool_that_is_not_hidden_mean_cls_or_a_few_token_ids_is_refused(pool):
    with pytest.raises(ValidationError):
        SamplingParams(pool=pool)
