"""Hostile messages on a live agent's port, property-based (hypothesis): msgpack headers with bad
versions, ops, types, sessions, slots and array descriptions (dtypes, shapes, sizes), frames that do
not match them or are cut short, raw bytes, and a frame over the largest legal one. The agent must
never die (same pid), answer each message with an error reply (the oversized frame: drop it), and a
stream a real server runs on it meanwhile must finish with exactly the answer it gives alone."""

import threading

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agent.contract import protocol
from agent_harness import LONG_ANSWERS_RUNTIME, AgentSocket, free_ports, serving_stack, write_config
from http_client import post

FUZZ = settings(
    max_examples=150,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
# Long enough to overlap the fuzzing; ignore_eos: the tiny model's answer always has this length.
STREAM_REQUEST = {
    "inputs": "The quick brown fox",
    "parameters": {"max_new_tokens": 120, "ignore_eos": True, "do_sample": True, "seed": 9, "top_k": 20},
}
REPLY_TIMEOUT_S = 10


@pytest.fixture(scope="module")
def stack(tmp_path_factory, tiny_llama_dir):
    """One agent behind a real server; yields (agents launcher, agent port, server URL, the
    stream's answer on the idle stack, the agent's pids before any fuzzing)."""
    agent_port, http_port = free_ports(2)
    path = write_config(
        tmp_path_factory.mktemp("agent-fuzz"),
        tiny_llama_dir,
        [agent_port],
        server={"port": http_port},
        runtime=LONG_ANSWERS_RUNTIME,
    )
    with serving_stack(path) as (agents, _server):
        url = f"http://127.0.0.1:{http_port}/models/tiny/generate"
        yield agents, agent_port, url, _answer(url), agents.agent_pids()


def _answer(url: str) -> str:
    response = post(url, STREAM_REQUEST)
    assert response.status_code == 200, response.text
    return response.json()["generated_text"]


class StreamsMeanwhile:
    """Asks the server for the stream's answer again and again while the fuzzing runs."""

    def __init__(self, url: str):
        self.url = url
        self.answers: list[str] = []
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self.done.is_set():
            self.answers.append(_answer(self.url))

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.done.set()
        self.thread.join(120)


@pytest.fixture(scope="module")
def streams(stack):
    """The server's streams run through every fuzz test of this module; the last test checks them."""
    url = stack[2]
    with StreamsMeanwhile(url) as meanwhile:
        yield meanwhile


@pytest.fixture(scope="module")
def fuzzer(stack, streams):
    """A DEALER that never opened a session (a reset would end the server's own session: with CURVE
    off any local process may do that, see protocol.py; agents.curve closes it)."""
    socket = AgentSocket(stack[1], session=False)
    yield socket
    socket.close()


anything = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats()
    | st.text(max_size=20)
    | st.binary(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=8,
)
# msgpack carries integers up to 2**64 - 1: a larger one would fail here, before the agent sees it
dims = st.integers(-(2**40), 2**64 - 1) | st.floats() | st.text(max_size=3) | st.none()
array_spec = st.one_of(
    st.tuples(st.sampled_from(sorted(protocol.ALLOWED_DTYPES)), st.lists(st.integers(0, 6), max_size=3)),
    st.tuples(
        st.sampled_from(["int8", "float64", "object", "U10", "", "<i4", "bool"]), st.lists(dims, max_size=3)
    ),
    st.tuples(anything, anything),
    anything,
).map(lambda spec: list(spec) if isinstance(spec, tuple) else spec)
# every op but a valid reset; the slot operations with no session, another one or a wrong type
ops = st.sampled_from([*protocol.SESSION_OPS, "reset", "fly", ""]) | anything
sessions = st.none() | st.integers(0, 2**62) | anything


@st.composite
def hostile_messages(draw) -> list[bytes]:
    header = {
        "v": draw(st.sampled_from([protocol.PROTOCOL_VERSION, protocol.PROTOCOL_VERSION, 2, None, "3"]))
    }
    header["op"] = draw(ops)
    for name, values in (("id", anything), ("slot", st.integers(-5, 10) | anything), ("sampling", anything)):
        if draw(st.booleans()):
            header[name] = draw(values)
    session = draw(sessions)
    if session is not None:
        header["session"] = session
    if header["op"] == "reset" and isinstance(session, int) and not isinstance(session, bool):
        header["session"] = str(session)  # a well-formed reset is not hostile: it opens a session
    specs = draw(st.lists(array_spec, max_size=3))
    header["arrays"] = specs if draw(st.integers(0, 9)) else draw(anything)
    frames = [_frame(draw, spec) for spec in specs]
    if draw(st.booleans()) and frames:
        frames[-1] = frames[-1][:-1]  # truncated
    return [msgpack.packb(header, use_bin_type=True), *frames]


def _frame(draw, spec) -> bytes:
    """The bytes a well-formed spec describes, or any bytes."""
    if (
        isinstance(spec, list)
        and len(spec) == 2
        and isinstance(spec[0], str)
        and spec[0] in protocol.ALLOWED_DTYPES
        and isinstance(spec[1], list)
        and all(type(d) is int and 0 <= d <= 6 for d in spec[1])
        and draw(st.booleans())
    ):
        size = int(np.prod(spec[1], dtype=np.int64)) * np.dtype(spec[0]).itemsize
        return draw(st.binary(min_size=size, max_size=size))
    return draw(st.binary(max_size=64))


@pytest.fixture(autouse=True)
def alive_after(stack):
    """Every test ends proving the agent lived: the same process, never restarted, answering."""
    yield
    agents, port, _, _, pids = stack
    assert agents.agent_pids() == pids and not any("restarting" in line for line in agents.lines)
    assert AgentSocket(port, session=False).call("ping")[0]["ok"]


def _expect_error_reply(fuzzer: AgentSocket, frames: list[bytes]) -> None:
    header, _ = fuzzer.raw(frames, timeout=REPLY_TIMEOUT_S)
    assert header["ok"] is False and header["kind"] in {"bad_request", "stale_session"}, header
    assert isinstance(header["error"], str) and header["error"], header


@FUZZ
@given(frames=hostile_messages())
def test_hostile_headers_and_frames_get_error_replies(stack, fuzzer, frames):
    _expect_error_reply(fuzzer, frames)


@FUZZ
@given(frames=st.lists(st.binary(max_size=200), min_size=1, max_size=4))
def test_raw_bytes_get_error_replies(stack, fuzzer, frames):
    _expect_error_reply(fuzzer, frames)


def test_an_oversized_frame_is_dropped_and_the_agent_serves_on(stack, streams):
    port = stack[1]
    limit = AgentSocket(port, session=False).call("info")[0]["max_frame_bytes"]
    oversized = AgentSocket(port, session=False)
    with pytest.raises(TimeoutError):
        oversized.raw([protocol.encode({"op": "ping", "id": 1})[0], b"\x00" * (limit + 1)], timeout=3)
    oversized.close()
    assert AgentSocket(port, session=False).call("ping")[0]["ok"]


def test_the_agent_lived_and_the_streams_got_exactly_their_answer(stack, streams):
    """Last: the same agent process throughout, and every stream run during the fuzzing (at least
    one) finished with the answer the idle stack gave."""
    agents, port, _, alone, pids = stack
    streams.__exit__()
    assert streams.answers and all(answer == alone for answer in streams.answers), streams.answers
    assert agents.agent_pids() == pids and not any("restarting" in line for line in agents.lines)
    assert AgentSocket(port, session=False).call("ping")[0]["ok"]
