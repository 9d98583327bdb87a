"""PD disaggregation at the runner and agent-service level: a prefilled slot moved to another
runner (its own KV cache) decodes exactly as it would have where it was prefilled; the transfer is
refused into a busy slot, in a wrong shape, after the scheduler cancelled it, or from a stale session."""

import numpy as np
import pytest

from agent.contract import protocol
from agent.contract.sampling import SamplingParams
from agent.model.formats import load_checkpoint
from agent.model.tokenizer import load_tokenizer
from agent.runner import ModelRunner, RunnerError
from agent.sampling import SlotSampler
from agent.service import AgentService
from conftest import TINY_RUNTIME

SEEDED = SamplingParams(do_sample=True, top_k=20, temperature=0.9, repetition_penalty=1.3, seed=11)


@pytest.fixture(scope="module")
def receiver(tiny_llama_dir) -> ModelRunner:
    """A second runner of the tiny model: another cache, like a decode agent's."""
    runner = ModelRunner.from_checkpoint(load_checkpoint(tiny_llama_dir), TINY_RUNTIME)
    runner.warm_up(lambda _line: None, role="decode")
    return runner


def continue_decoding(runner, slot, n):
    tokens = []
    for _ in range(n):
        tokens += runner.decode([slot])
    return tokens


@pytest.mark.parametrize("params", [SamplingParams(), SEEDED], ids=["greedy", "seeded"])
def test_moved_slot_decodes_as_it_would_have_at_home(
    tiny_llama_runner, tiny_llama_dir, receiver, release_all, params
):
    release_all(tiny_llama_runner)
    release_all(receiver)
    tok = load_tokenizer(tiny_llama_dir)
    prompt = tok.encode("The quick brown fox jumps over the lazy dog, twice")
    first = tiny_llama_runner.prefill(1, prompt, params)
    blocks, state = tiny_llama_runner.export_kv(1)
    spec = tiny_llama_runner.spec
    assert blocks.shape == (2 * spec.num_layers, spec.num_kv_heads, len(prompt), spec.head_dim)
    assert state["next_token"] == first
    at_home = continue_decoding(tiny_llama_runner, 1, 12)

    # Another sequence already decoding on the receiver shares its batch with the moved one.
    other = tok.encode("你好，世界")
    other_alone = [receiver.prefill(0, other, SamplingParams())] + continue_decoding(receiver, 0, 12)
    receiver.release(0)
    receiver.prefill(0, other, SamplingParams())
    receiver.import_kv(3, blocks, state)
    together = [receiver.decode([0, 3]) for _ in range(12)]
    assert [step[1] for step in together] == at_home
    assert [step[0] for step in together] == other_alone[1:]


def test_sampler_state_round_trip_continues_the_same_draws():
    sampler = SlotSampler(SEEDED, [5, 6, 7], vocab_size=50)
    rng = np.random.default_rng(0)
    values, ids = np.sort(rng.normal(size=50))[::-1].copy(), rng.permutation(50)
    for _ in range(3):
        sampler.choose(values, ids)
    copy = SlotSampler.from_state(protocol.decode(protocol.encode({"s": sampler.state()}))[0]["s"], 50)
    assert [copy.choose(values, ids) for _ in range(20)] == [sampler.choose(values, ids) for _ in range(20)]


def test_import_refuses_busy_slot_wrong_shape_and_bad_state(tiny_llama_runner, receiver, release_all):
    release_all(tiny_llama_runner)
    release_all(receiver)
    tiny_llama_runner.prefill(0, [3, 4, 5, 6], SamplingParams())
    blocks, state = tiny_llama_runner.export_kv(0)
    receiver.prefill(2, [1, 2], SamplingParams())
    with pytest.raises(RunnerError, match="slot 2 is in use"):
        receiver.import_kv(2, blocks, state)
    with pytest.raises(RunnerError, match="do not fit"):
        receiver.import_kv(1, blocks[:, :, :3], state)
    with pytest.raises(RunnerError, match="outside the vocabulary"):
        receiver.import_kv(1, blocks, {**state, "next_token": 10**6})
    with pytest.raises(RunnerError, match="1..63 positions"):
        receiver.import_kv(1, np.zeros((1, 1, 65, 1), np.float32), {**state, "length": 65})
    assert 1 not in receiver.slots


def receive_frames(session, slot, ticket, blocks, state):
    return protocol.encode(
        {"op": "kv_receive", "id": 1, "session": session, "slot": slot, "ticket": ticket, "state": state},
        [blocks, np.arange(slot * 4, slot * 4 + 4, dtype=np.int32)],  # the slot's 4 blocks of 16
    )


def test_service_refuses_a_cancelled_or_stale_transfer(tiny_llama_runner, receiver, release_all):
    """A transfer the scheduler gave up on (its release with the ticket came first) must never
    land in a slot a later request gets: no KV of one request is ever read by another."""
    release_all(tiny_llama_runner)
    release_all(receiver)
    service = AgentService(receiver, model_name="tiny", rank=0, port=0, role="decode")
    service.handle(protocol.encode({"op": "reset", "id": 0, "session": 7}))
    tiny_llama_runner.prefill(0, [3, 4, 5, 6], SamplingParams())
    blocks, state = tiny_llama_runner.export_kv(0)

    header, _ = protocol.decode(service.handle(receive_frames(6, 1, 100, blocks, state)))
    assert not header["ok"] and header["kind"] == "stale_session"

    release = protocol.encode({"op": "release", "id": 2, "session": 7, "slot": 1, "ticket": 101})
    assert protocol.decode(service.handle(release))[0]["ok"]
    header, _ = protocol.decode(service.handle(receive_frames(7, 1, 101, blocks, state)))
    assert not header["ok"] and "cancelled" in header["error"]
    assert 1 not in receiver.slots

    header, _ = protocol.decode(service.handle(receive_frames(7, 1, 102, blocks, state)))
    assert header["ok"] and receiver.slot_length(1) == 4


def test_an_older_server_cannot_take_the_agent_back(receiver, release_all):
    """Sessions carry the server's start time (epoch): a newer server's reset wins; an older one's
    (its recovery after the agent came back, say) is refused, so two servers never alternate."""
    release_all(receiver)
    service = AgentService(receiver, model_name="tiny", rank=0, port=0, role="decode")

    def reset(session: int, epoch: int) -> dict:
        return protocol.decode(
            service.handle(protocol.encode({"op": "reset", "id": 0, "session": session, "epoch": epoch}))
        )[0]

    assert reset(1, epoch=100)["ok"] and reset(2, epoch=200)["ok"]  # the newer server takes over
    refused = reset(3, epoch=150)
    assert not refused["ok"] and refused["kind"] == "stale_session" and "newer server" in refused["error"]
    assert service.session == 2
    assert reset(4, epoch=200)["ok"]  # the same server reconnecting opens a fresh session
