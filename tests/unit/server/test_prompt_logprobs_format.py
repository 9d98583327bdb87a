"""Prompt logprobs, pure parts: the agent's scoring of logit rows against a float64 log-softmax
computed here independently; the chunk and reply fields on the wire (a reply that does not fit its
request is refused); the three API shapes (OpenAI echo, vLLM prompt_logprobs, TGI prefill) over a
real byte-level tokenizer; and the completions schema's prompts (text, ids, lists; bounds)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from pydantic import ValidationError
from tokenizers import Tokenizer, decoders, models

from agent.contract import protocol
from agent.contract.prompt_logprobs import PromptLogprob, score_rows
from agent.contract.sampling import Sampled, SamplingParams
from agent.contract.step import StepChunk, StepRequest
from agent.contract.step_reply import StepReply
from agent.model.tokenizer import TextTokenizer
from server.logprob_format import LogprobFormatter
from server.openai_schema import MAX_PROMPTS, CompletionRequest

VOCAB = 50


def reference(row: np.ndarray, token: int) -> tuple[float, int]:
    """log-softmax at `token` and its rank, the plain way."""
    logs = [float(v) - math.log(sum(math.exp(float(w)) for w in row)) for v in row]
    return logs[token], 1 + sum(v > logs[token] for v in logs)


def test_score_rows_is_the_log_softmax_at_each_target():
    rng = np.random.default_rng(0)
    logits = rng.normal(0, 4, (70, VOCAB)).astype(np.float32)  # past one block of 64 rows
    logits[5, [3, 7]] = 30.0  # a tie for the best: by id
    targets = rng.integers(0, VOCAB, 70)
    entries = score_rows(logits, targets, 3)
    assert len(entries) == 70
    for row, (entry, target) in enumerate(zip(entries, targets)):
        value, rank = reference(logits[row].astype(np.float64), int(target))
        assert entry.logprob == pytest.approx(value, abs=1e-9) and entry.rank == rank
        order = sorted(range(VOCAB), key=lambda t: (-logits[row, t], t))[:3]
        assert [t for t, _ in entry.top] == order
    assert [t for t, _ in entries[5].top[:2]] == [3, 7]
    assert all(e.top == () for e in score_rows(logits[:2], targets[:2], 0))


def test_chunk_and_reply_carry_prompt_logprobs():
    chunk = StepChunk(1, [5, 6, 7, 8], [0], 1, prompt_logprobs=2, lookahead=9)
    assert chunk.scores == 3  # rows 1..3: tokens 7, 8 and the lookahead 9
    request = StepRequest(chunks=[chunk, StepChunk(2, [4, 4], [1], 0, SamplingParams())])
    fields, arrays = request.to_wire()
    header, out = protocol.decode(protocol.encode({"op": "step", "id": 1, **fields}, arrays))
    got = StepRequest.from_wire(header, out, 4)
    assert got.chunks[0].prompt_logprobs == 2 and got.chunks[0].lookahead == 9
    assert got.chunks[1].prompt_logprobs is None and got.chunks[1].scores == 0
    entries = [
        PromptLogprob(-0.5, 1, ((3, -0.5), (4, -1.5))),
        PromptLogprob(-2.0, 3, ()),
        PromptLogprob(-1.0, 2),
    ]
    reply = StepReply([], [None, Sampled(4)], prompts=[entries, None])
    fields, arrays = reply.to_wire()
    header, out = protocol.decode(protocol.encode({"op": "step", "id": 1, "ok": True, **fields}, arrays))
    assert StepReply.from_wire(header, out, request, VOCAB).prompts == [entries, None]
    for bad in (
        entries[:2],  # one short
        [*entries[:2], [0.5, 1, []]],  # a logprob above 0
        [*entries[:2], [-1.0, 0, []]],  # no rank
        [*entries[:2], [-1.0, 1, [[VOCAB, -1.0]]]],  # outside the vocabulary
        [*entries[:2], [-1.0, 1, [[1, -1.0], [2, -1.0], [3, -1.0]]]],  # more than asked
    ):
        wire = [[e.to_wire() if isinstance(e, PromptLogprob) else e for e in bad], None]
        with pytest.raises(ValueError, match="prompt logprob"):
            StepReply.from_wire({**header, "chunk_prompt_logprobs": wire}, out, request, VOCAB)
    with pytest.raises(ValueError, match="prompt_logprobs"):
        spec = {"slot": 1, "start": 0, "sample": False, "prompt_logprobs": [21, None]}
        StepChunk.from_wire(spec, np.asarray([1, 2]), np.asarray([0]))


@pytest.fixture(scope="module")
def formatter() -> LogprobFormatter:
    vocab = {"<s>": 0, "a": 1, "b": 2, "c": 3, "d": 4}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.decoder = decoders.ByteLevel()
    return LogprobFormatter(TextTokenizer(tokenizer, None, "<s>", None, ()))


PROMPT = [0, 1, 2, 3]
ENTRIES = [
    PromptLogprob(-0.1, 1, ((1, -0.1), (4, -2.5))),
    PromptLogprob(-3.0, 2, ((3, -0.2), (2, -3.0))),
    PromptLogprob(-4.0, 5, ((1, -0.3), (2, -1.6))),
]


def test_echo_shape(formatter):
    shown = formatter.echo(PROMPT, ENTRIES, 1)
    assert shown == {
        "tokens": ["<s>", "a", "b", "c"],
        "token_logprobs": [None, -0.1, -3.0, -4.0],
        "top_logprobs": [None, {"a": -0.1}, {"c": -0.2}, {"a": -0.3}],
        "text_offset": [0, 3, 4, 5],
    }
    # positions with no entry (none computed) show null
    assert formatter.echo(PROMPT, ENTRIES[:1], 0)["token_logprobs"] == [None, -0.1, None, None]


def test_vllm_prompt_logprobs_shape(formatter):
    shown = formatter.vllm_prompt(PROMPT, ENTRIES, 2)
    assert shown[0] is None and len(shown) == 4
    assert shown[1] == {
        "1": {"logprob": -0.1, "rank": 1, "decoded_token": "a"},
        "4": {"logprob": -2.5, "rank": 2, "decoded_token": "d"},
    }
    assert shown[2] == {  # its token ranked second: among the best
        "3": {"logprob": -0.2, "rank": 1, "decoded_token": "c"},
        "2": {"logprob": -3.0, "rank": 2, "decoded_token": "b"},
    }
    assert shown[3]["3"] == {"logprob": -4.0, "rank": 5, "decoded_token": "c"}  # its token besides the k
    assert len(shown[3]) == 3
    assert formatter.vllm_prompt(PROMPT, ENTRIES, 0)[1] == {
        "1": {"logprob": -0.1, "rank": 1, "decoded_token": "a"}
    }


def test_tgi_prefill_shape(formatter):
    assert formatter.tgi_prefill(PROMPT, ENTRIES) == [
        {"id": 0, "text": "<s>", "logprob": None},
        {"id": 1, "text": "a", "logprob": -0.1},
        {"id": 2, "text": "b", "logprob": -3.0},
        {"id": 3, "text": "c", "logprob": -4.0},
    ]


def test_completion_prompts():
    def request(**fields) -> CompletionRequest:
        return CompletionRequest(model="m", **fields)

    assert request(prompt="hi").prompts == ["hi"]
    assert request(prompt=[1, 2]).prompts == [[1, 2]]
    assert request(prompt=["a", "b"]).prompts == ["a", "b"]
    assert request(prompt=[[1], [2, 3]]).prompts == [[1], [2, 3]]
    for prompt in ([], [[]], [1, "a"], ["a"] * (MAX_PROMPTS + 1), [[1]] * (MAX_PROMPTS + 1), 7):
        with pytest.raises(ValidationError):
            request(prompt=prompt)
    with pytest.raises(ValidationError, match="choices"):
        request(prompt=["a"] * 16, n=8)
    with pytest.raises(ValidationError, match="max_tokens 0"):
        request(prompt="a", max_tokens=0)
    assert request(prompt="a", max_tokens=0, echo=True).prompt_logprobs_asked() is None
    assert request(prompt="a", echo=True, logprobs=2, prompt_logprobs=4).prompt_logprobs_asked() == 4
    assert request(prompt="a", echo=True, logprobs=5, prompt_logprobs=1).prompt_logprobs_asked() == 5
    assert request(prompt="a", logprobs=5).prompt_logprobs_asked() is None  # no echo: none computed
