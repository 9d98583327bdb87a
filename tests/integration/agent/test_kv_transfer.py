"""PD disaggregation at the runner and agent-service level: a prefilled slot moved to another
runner (its own KV cache) decodes exactly as it would have where it was prefilled; the transfer is
refused into a busy slot, in a wrong shape, after the scheduler cancelled it, or from a stale session.
A real decode agent (CURVE on) refuses a peer's state whose token ids or counts are out of range."""

import numpy as np
import pytest
import zmq
from conftest import TINY_RUNTIME

import runner_calls as calls
from agent.contract import protocol
from agent.contract.sampling import SamplingParams
from agent.contract.transport import ClientKeys, secure_client_socket
from agent.kv_transfer import export_kv, import_kv
from agent.model.formats import load_checkpoint
from agent.model.tokenizer import load_tokenizer
from agent.runner import ModelRunner, RunnerError
from agent.sampling import SlotSampler
from agent.service import AgentService
from agent.warm_up import warm_up
from agent_harness import LauncherProcess, curve_keys, free_ports, slot_blocks, write_config

SEEDED = SamplingParams(do_sample=True, top_k=20, temperature=0.9, repetition_penalty=1.3, seed=11)


@pytest.fixture(scope="module")
def receiver(tiny_llama_dir) -> ModelRunner:
    """A second runner of the tiny model: another cache, like a decode agent's."""
    runner = ModelRunner.from_checkpoint(load_checkpoint(tiny_llama_dir), TINY_RUNTIME)
    warm_up(runner, lambda _line: None, role="decode")
    return runner


def continue_decoding(runner, slot, n):
    tokens = []
    for _ in range(n):
        tokens += calls.decode(runner, [slot])
    return tokens


@pytest.mark.parametrize("params", [SamplingParams(), SEEDED], ids=["greedy", "seeded"])
def test_moved_slot_decodes_as_it_would_have_at_home(
    tiny_llama_runner, tiny_llama_dir, receiver, release_all, params
):
    release_all(tiny_llama_runner)
    release_all(receiver)
    tok = load_tokenizer(tiny_llama_dir)
    prompt = tok.encode("The quick brown fox jumps over the lazy dog, twice")
    first = calls.prefill(tiny_llama_runner, 1, prompt, params)
    blocks, _, state = export_kv(tiny_llama_runner, 1)
    spec = tiny_llama_runner.spec
    assert blocks.shape == (2 * spec.num_layers, spec.num_kv_heads, len(prompt), spec.head_dim)
    assert state["next_token"] == first
    at_home = continue_decoding(tiny_llama_runner, 1, 12)

    # Another sequence already decoding on the receiver shares its batch with the moved one.
    other = tok.encode("你好，世界")
    other_alone = [calls.prefill(receiver, 0, other, SamplingParams())] + continue_decoding(receiver, 0, 12)
    receiver.release(0)
    calls.prefill(receiver, 0, other, SamplingParams())
    import_kv(receiver, 3, blocks, state)
    together = [calls.decode(receiver, [0, 3]) for _ in range(12)]
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
    calls.prefill(tiny_llama_runner, 0, [3, 4, 5, 6], SamplingParams())
    blocks, _, state = export_kv(tiny_llama_runner, 0)
    calls.prefill(receiver, 2, [1, 2], SamplingParams())
    with pytest.raises(RunnerError, match="slot 2 is in use"):
        import_kv(receiver, 2, blocks, state)
    with pytest.raises(RunnerError, match="do not fit"):
        import_kv(receiver, 1, blocks[:, :, :3], state)
    with pytest.raises(RunnerError, match="outside the vocabulary"):
        import_kv(receiver, 1, blocks, {**state, "next_token": 10**6})
    with pytest.raises(RunnerError, match="1..63 positions"):
        import_kv(receiver, 1, np.zeros((1, 1, 65, 1), np.float32), {**state, "length": 65})
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
    calls.prefill(tiny_llama_runner, 0, [3, 4, 5, 6], SamplingParams())
    blocks, _, state = export_kv(tiny_llama_runner, 0)

    header, _ = protocol.decode(service.handle(receive_frames(6, 1, 100, blocks, state)))
    assert not header["ok"] and header["kind"] == "stale_session"

    release = protocol.encode({"op": "release", "id": 2, "session": 7, "slot": 1, "ticket": 101})
    assert protocol.decode(service.handle(release))[0]["ok"]
    header, _ = protocol.decode(service.handle(receive_frames(7, 1, 101, blocks, state)))
    assert not header["ok"] and "cancelled" in header["error"]
    assert 1 not in receiver.slots

    header, _ = protocol.decode(service.handle(receive_frames(7, 1, 102, blocks, state)))
    assert header["ok"] and receiver.slot_table.slot_length(1) == 4


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


class CurveDealer:
    """A synchronous DEALER to one agent under a CURVE keypair (the server's, or a peer agent's)."""

    def __init__(self, port: int, keypair: tuple[str, str], agent_public_key: str):
        self.socket = zmq.Context.instance().socket(zmq.DEALER)
        self.socket.setsockopt(zmq.LINGER, 0)
        secure_client_socket(self.socket, ClientKeys(*keypair, agent_public_key=agent_public_key))
        self.socket.connect(f"tcp://127.0.0.1:{port}")

    def call(self, op: str, arrays=(), **fields) -> tuple[dict, list]:
        self.socket.send_multipart(protocol.encode({"op": op, "id": 1, **fields}, arrays))
        assert self.socket.poll(30_000), f"no answer to {op}"
        return protocol.decode(self.socket.recv_multipart())

    def close(self) -> None:
        self.socket.close(linger=0)


@pytest.fixture(scope="module")
def decode_agent(tmp_path_factory, tiny_llama_dir):
    """The decode agent of a prefill/decode pair with CURVE keys, started alone (`--groups 1`, as
    on its own host); yields a socket with the server's keys and one with the prefill agent's."""
    ports = free_ports(2)
    keys = curve_keys(2)
    groups = [{"role": "prefill", "ports": [ports[0]]}, {"role": "decode", "ports": [ports[1]]}]
    path = write_config(
        tmp_path_factory.mktemp("decode-agent"),
        tiny_llama_dir,
        ports,
        agents={"groups": groups, "curve": keys},
    )
    agents = LauncherProcess(path, args=("--groups", "1"))
    server = peer = None
    try:
        agents.wait_for("all agents started", 240)
        decode_public = keys["agents"][1]["public_key"]
        server = CurveDealer(ports[1], (keys["server_public_key"], keys["server_secret_key"]), decode_public)
        prefill = keys["agents"][0]
        peer = CurveDealer(ports[1], (prefill["public_key"], prefill["secret_key"]), decode_public)
        yield server, peer
    finally:
        for socket in (server, peer):
            if socket is not None:
                socket.close()
        agents.close()


def test_a_peers_state_with_token_ids_or_counts_out_of_range_is_refused(decode_agent, tiny_llama_dir):
    """A prefill agent's key may send kv_receive; a state naming a token id outside the vocabulary
    (or a count out of range) must be refused at once, leaving the slot free, and never reach a
    decode step: there it failed the whole batch (an IndexError in numpy), or, with a negative id,
    penalised a token the state did not name."""
    server, peer = decode_agent
    vocab = server.call("info")[0]["vocab_size"]
    spec = load_checkpoint(tiny_llama_dir).spec
    length, session = 5, 41
    blocks = np.zeros((2 * spec.num_layers, spec.num_kv_heads, length, spec.head_dim), np.float32)
    params = SamplingParams(do_sample=True, repetition_penalty=1.2, presence_penalty=0.5, seed=3)
    sampler = SlotSampler(params, [1, 2, 3], vocab)
    sampler.observe(4)
    state = {"length": length, "next_token": 7, "sampler": sampler.state()}
    assert server.call("reset", session=session)[0]["ok"]

    def receive(slot: int, ticket: int, sampler_state: dict, **changed) -> dict:
        fields = {"slot": slot, "session": session, "ticket": ticket}
        arrays = [blocks, slot_blocks(slot)]
        sent = {**state, "sampler": sampler_state, **changed}
        return peer.call("kv_receive", arrays, state=sent, **fields)[0]

    assert receive(0, 1, state["sampler"])["ok"]  # a sequence decoding beside the refused ones
    good = state["sampler"]
    hostile = [
        ({**good, "seen": [1, vocab + 5]}, f"seen: token id {vocab + 5} is outside the vocabulary"),
        ({**good, "seen": [-1]}, "seen: token id -1 is outside the vocabulary"),
        ({**good, "seen": [2.0]}, "seen: token id 2.0"),
        ({**good, "counts": [[vocab, 1]]}, f"counts: token id {vocab} is outside the vocabulary"),
        ({**good, "counts": [[-3, 1]]}, "counts: token id -3"),
        ({**good, "counts": [[4, -2]]}, "occurrences must be 1..generated"),
        ({**good, "generated": -1}, "generated must be a count"),
        ({**good, "params": {**good["params"], "stop_token_ids": [vocab]}}, f"token id {vocab}"),
        ({**good, "key": -1}, "key must be a 64-bit unsigned integer"),
        ({**good, "key": "7"}, "key must be a 64-bit unsigned integer"),
    ]
    for ticket, (sampler_state, words) in enumerate(hostile, start=2):
        answer = receive(1, ticket, sampler_state)
        assert not answer["ok"] and "sampler is refused" in answer["error"], (sampler_state, answer)
        assert words in answer["error"], answer
    bad_tokens = [(vocab, f"next_token {vocab} is outside"), (True, "integer")]
    for ticket, (token, words) in enumerate(bad_tokens, start=50):
        answer = receive(1, ticket, good, next_token=token)
        assert not answer["ok"] and words in answer["error"], answer
    decode = [np.array([0], np.int32), slot_blocks(0)[None]]
    header, arrays = server.call("step", decode, chunks=[], session=session)
    assert header["ok"] and 0 <= arrays[0][0] < vocab, header
    assert receive(1, 99, good)["ok"]  # the refused transfers left the slot as it was: free
    tables = np.stack([slot_blocks(0), slot_blocks(1)])
    header, arrays = server.call("step", [np.array([0, 1], np.int32), tables], chunks=[], session=session)
    assert header["ok"] and len(arrays[0]) == 2, header
