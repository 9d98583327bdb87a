"""Hostile gRPC clients (server/grpc_guards.py) against a real agent and `start_server.py` on the tiny
model, each attack beside a victim whose greedy answer (computed alone first) must come out unchanged
while /health answers within a second:

- one ModelStreamInfer stream of hundreds of fast-failing messages, each with a 0.9 MB `id` its
  reply copies, its replies unread: the server stops reading it and its memory stays bounded (on
  main every message got a task and every reply an unbounded queue: +390 MB for 400 messages);
- a stream whose client stops reading has its running answer aborted and its slot freed;
- a unary call whose message never comes or comes a few bytes at a time, and an idle stream, are
  ended after their timeouts (on main they held their call slots for good);
- one peer's idle calls cannot take every call slot: another peer is still served.

The calls no gRPC library makes (a message trickled, a call that sends nothing, from another
loopback address) come from `RawCalls`, a few lines of HTTP/2.
"""

import contextlib
import json
import socket
import struct
import threading
import time

import grpc
import httpx
import numpy as np
import psutil
import pytest
import tritonclient.grpc as triton_grpc

from agent_harness import LONG_ANSWERS_RUNTIME, free_ports, serving_stack, write_config
from attack_watch import under_attack
from http_client import aborted_requests
from server.protos import grpc_service_pb2 as pb
from server.protos import grpc_service_pb2_grpc as pb_grpc
from waiting import wait_until

KEY = "grpc-hostile-key"
AUTH = {"authorization": f"Bearer {KEY}"}
RUNTIME = {**LONG_ANSWERS_RUNTIME, "max_seq_len": 2048, "attend_buckets": [64, 512, 2048]}
MAX_CALLS, PER_PEER = 16, 8
READ_TIMEOUT_S = IDLE_TIMEOUT_S = 2.0
WRITE_TIMEOUT_S = 1.0
STREAM_REQUESTS = 4
VICTIM_PROMPT = "The capital of France is"
VICTIM_TOKENS = 800
ATTACKER = "127.0.0.2"  # another peer than the victims' 127.0.0.1, on the same loopback
INFER, STREAM_INFER = (
    "/inference.GRPCInferenceService/ModelInfer",
    "/inference.GRPCInferenceService/ModelStreamInfer",
)


@pytest.fixture(scope="module")
def stack(tmp_path_factory, tiny_llama_dir):
    """(HTTP base URL, gRPC port, the server's LauncherProcess)."""
    agent_port, http_port, grpc_port = free_ports(3)
    path = write_config(
        tmp_path_factory.mktemp("grpc-hostile"),
        tiny_llama_dir,
        [agent_port],
        runtime=RUNTIME,
        server={
            "port": http_port,
            "grpc_port": grpc_port,
            "api_keys": [KEY],
            "max_connections": MAX_CALLS,
            "grpc_max_calls_per_peer": PER_PEER,
            "read_timeout_s": READ_TIMEOUT_S,
            "grpc_idle_timeout_s": IDLE_TIMEOUT_S,
            "stream_write_timeout_s": WRITE_TIMEOUT_S,
            "grpc_stream_max_requests": STREAM_REQUESTS,
        },
    )
    with serving_stack(path) as (_, server):
        yield f"http://127.0.0.1:{http_port}", grpc_port, server


def victim_infer(port: int) -> str:
    """A greedy answer long enough to run through an attack, by ModelInfer from 127.0.0.1."""
    text = triton_grpc.InferInput("text_input", [1], "BYTES")
    text.set_data_from_numpy(np.array([VICTIM_PROMPT.encode()], dtype=object))
    with triton_grpc.InferenceServerClient(f"127.0.0.1:{port}") as client:
        parameters = {"max_tokens": VICTIM_TOKENS, "temperature": 0.0, "ignore_eos": True}
        reply = client.infer("tiny", [text], parameters=parameters, headers=AUTH)
    return reply.as_numpy("text_output")[0].decode()


@pytest.fixture(scope="module")
def expected(stack) -> str:
    return victim_infer(stack[1])


def infer_request(request_id: str, prompt: str | None = None, **parameters) -> pb.ModelInferRequest:
    """A ModelInferRequest of `prompt` (none: one that fails at once, it has no text_input)."""
    request = pb.ModelInferRequest(model_name="tiny", id=request_id)
    if prompt is not None:
        tensor = request.inputs.add(name="text_input", datatype="BYTES", shape=[1])
        tensor.contents.bytes_contents.append(prompt.encode())
    for name, value in parameters.items():
        kind = (
            "bool_param"
            if isinstance(value, bool)
            else "int64_param"
            if isinstance(value, int)
            else "double_param"
        )
        setattr(request.parameters[name], kind, value)
    return request


def stream_call(port: int, requests, timeout: float = 90):
    """(its channel, a ModelStreamInfer call sending `requests`), with a deadline a test outlives."""
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    stub = pb_grpc.GRPCInferenceServiceStub(channel)
    return channel, stub.ModelStreamInfer(requests, metadata=tuple(AUTH.items()), timeout=timeout)


def read_to_the_end(call) -> tuple[int, grpc.RpcError | None]:
    """(the replies a stream call still gives, the error it ends with)."""
    replies = 0
    try:
        for _ in call:
            replies += 1
    except grpc.RpcError as exc:
        return replies, exc
    return replies, None


def get(base: str, path: str) -> str:
    return httpx.get(f"{base}{path}", headers=AUTH, timeout=30).text


def running(base: str) -> int:
    return json.loads(get(base, "/serving/get_bs").split("data:", 1)[1])["data"]


class PeakRss:
    """The largest resident size of a process while the block runs, sampled every 20 ms."""

    def __init__(self, pid: int):
        self.process, self.peak = psutil.Process(pid), 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._stop.wait(0.02):
            self.peak = max(self.peak, self.process.memory_info().rss)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


class RawCalls:
    """One HTTP/2 connection from `source` speaking just enough gRPC to open calls that send their
    message slowly or never; `ended[stream]` is when the server ended each (its trailers or a
    RST_STREAM), measured from the call's start, its keys in the order the calls ended."""

    DATA, HEADERS, RST_STREAM, SETTINGS, PING = 0, 1, 3, 4, 6

    def __init__(self, port: int, source: str = ATTACKER):
        self.sock = socket.socket()
        self.sock.bind((source, 0))
        self.sock.connect(("127.0.0.1", port))
        self.sock.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + self._frame(self.SETTINGS, 0, 0))
        self.started: dict[int, float] = {}
        self.ended: dict[int, float] = {}
        self._next = 1
        self._lock = threading.Lock()
        threading.Thread(target=self._read, daemon=True).start()

    def _frame(self, kind: int, flags: int, stream: int, payload: bytes = b"") -> bytes:
        return len(payload).to_bytes(3, "big") + bytes([kind, flags]) + stream.to_bytes(4, "big") + payload

    def _send(self, *frame) -> None:
        with self._lock:
            self.sock.sendall(self._frame(*frame))

    def open(self, path: str) -> int:
        """A call's headers (literal, not indexed), no message yet: its stream."""
        headers = [
            (b":method", b"POST"),
            (b":scheme", b"http"),
            (b":path", path.encode()),
            (b":authority", b"127.0.0.1"),
            (b"content-type", b"application/grpc"),
            (b"te", b"trailers"),
            (b"authorization", AUTH["authorization"].encode()),
        ]
        block = b"".join(b"\x00" + bytes([len(n)]) + n + bytes([len(v)]) + v for n, v in headers)
        stream, self._next = self._next, self._next + 2
        self.started[stream] = time.monotonic()
        self._send(self.HEADERS, 0x4, stream, block)  # END_HEADERS
        return stream

    def send(self, stream: int, data: bytes) -> None:
        self._send(self.DATA, 0, stream, data)

    def _read(self) -> None:
        with contextlib.suppress(OSError):  # closed by the test
            self._read_frames()

    def _read_frames(self) -> None:
        buffer = b""
        while chunk := self.sock.recv(1 << 16):
            buffer += chunk
            while len(buffer) >= 9 and len(buffer) >= 9 + (length := int.from_bytes(buffer[:3], "big")):
                kind, flags, stream = buffer[3], buffer[4], int.from_bytes(buffer[5:9], "big")
                payload, buffer = buffer[9 : 9 + length], buffer[9 + length :]
                if kind == self.SETTINGS and not flags & 1:
                    self._send(self.SETTINGS, 1, 0)  # ACK
                elif kind == self.PING and not flags & 1:
                    self._send(self.PING, 1, 0, payload)
                elif (kind == self.HEADERS and flags & 1) or kind == self.RST_STREAM:
                    self.ended.setdefault(stream, time.monotonic() - self.started[stream])

    def close(self) -> None:
        self.sock.close()


def test_a_stream_of_unread_replies_keeps_the_server_memory_bounded(stack, expected):
    """400 messages of a 0.9 MB id, each failing at once (no text_input), replies unread: the server
    reads a few (grpc_stream_max_requests running, as many replies queued), then the client's sends
    wait; the unread replies stall the stream, which ends DEADLINE_EXCEEDED once read."""
    base, port, server = stack
    big_id = "i" * 900_000
    sent = []

    def messages():
        for _ in range(400):
            sent.append(1)
            yield infer_request(big_id)

    process = psutil.Process(server.process.pid)
    before = process.memory_info().rss
    log_start = len(server.lines)
    with under_attack(base, lambda: victim_infer(port), expected, name="gRPC unread replies"):
        with PeakRss(server.process.pid) as rss:
            channel, call = stream_call(port, messages())
            # Until the stream stalls (fixed), or the client sent everything (main).
            wait_until(
                lambda: "read no reply" in "\n".join(server.lines[log_start:]) or len(sent) == 400,
                30,
                "the stream stalled or every message sent",
            )
            # The attack goes on a second past the stall: a server still reading it would show
            # in `sent` and in the peak RSS.
            time.sleep(1)
        replies, error = read_to_the_end(call)
        channel.close()
    growth_mb = (rss.peak - before) / 1e6
    assert growth_mb < 100, (
        f"grew {growth_mb:.0f} MB ({before / 1e6:.0f} -> {rss.peak / 1e6:.0f}) on unread replies"
    )
    assert len(sent) < 100, f"the server read {len(sent)} messages while its replies were not read"
    assert error is not None and error.code() == grpc.StatusCode.DEADLINE_EXCEEDED, error
    assert "stream_write_timeout_s" in error.details() and replies < len(sent)


def test_a_stalled_stream_has_its_answer_aborted_and_slot_freed(stack, expected):
    """A 2000-token answer whose 100 kB replies (its id copied) are not read: once the client's
    buffers are full and stream_write_timeout_s passes, the answer is aborted and its slot freed."""
    base, port, _ = stack
    aborted_before = aborted_requests(base, AUTH)
    request = infer_request("s" * 100_000, VICTIM_PROMPT, max_tokens=2000, ignore_eos=True, temperature=0.0)
    with under_attack(base, lambda: victim_infer(port), expected, name="gRPC stalled stream"):
        channel, call = stream_call(port, iter([request]))
        try:
            wait_until(
                lambda: aborted_requests(base, AUTH) == aborted_before + 1, 60, "the stalled answer aborted"
            )
        finally:
            replies, error = read_to_the_end(call)
            channel.close()
    wait_until(lambda: running(base) == 0, 10, "its slot freed")
    assert error is not None and error.code() == grpc.StatusCode.DEADLINE_EXCEEDED, error
    assert "stream_write_timeout_s" in error.details() and replies < 2000


def stream_victim(port: int) -> str:
    """The victim's answer on a ModelStreamInfer stream: it runs longer than the idle timeout, and
    its stream is not idle meanwhile."""
    results: list = []
    done = threading.Event()

    def callback(result, error):
        results.append((result, error))
        if error or result.get_response().parameters["triton_final_response"].bool_param:
            done.set()

    text = triton_grpc.InferInput("text_input", [1], "BYTES")
    text.set_data_from_numpy(np.array([VICTIM_PROMPT.encode()], dtype=object))
    with triton_grpc.InferenceServerClient(f"127.0.0.1:{port}") as client:
        client.start_stream(callback=callback, headers=AUTH)
        parameters = {"max_tokens": VICTIM_TOKENS, "temperature": 0.0, "ignore_eos": True}
        client.async_stream_infer("tiny", [text], parameters=parameters, enable_empty_final_response=True)
        assert done.wait(120)
        client.stop_stream()
    assert all(error is None for _, error in results), results[-1]
    return "".join(result.as_numpy("text_output")[0].decode() for result, _ in results[:-1])


def test_idle_and_slow_calls_are_ended_after_their_timeouts(stack, expected):
    """A unary call that never sends its message, one that sends it two bytes every 0.1 s, and a
    stream that sends nothing each end within their timeout (and a margin), while another stream
    with an answer running past the idle timeout goes on."""
    base, port, _ = stack
    raw = RawCalls(port)
    quiet = threading.Event()
    try:
        with under_attack(base, lambda: stream_victim(port), expected, name="gRPC idle and slow calls"):
            channel, idle_stream = stream_call(port, iter(quiet.wait, True), timeout=15)  # sends nothing
            never = raw.open(INFER)
            slow = raw.open(INFER)
            message = infer_request("slow" * 50, VICTIM_PROMPT, max_tokens=4).SerializeToString()
            raw.send(slow, struct.pack(">BI", 0, len(message)))
            for i in range(0, 90, 2):  # 4.5 s of it, never all of it
                if slow in raw.ended:
                    break
                raw.send(slow, message[i : i + 2])
                time.sleep(0.1)  # the slow client: two bytes every 0.1 s
            _, error = read_to_the_end(idle_stream)
            quiet.set()
            channel.close()
        # A clock is the subject: each call ended by its timeout (and a margin), not held on.
        assert never in raw.ended and raw.ended[never] < READ_TIMEOUT_S + 2, raw.ended
        assert slow in raw.ended and raw.ended[slow] < READ_TIMEOUT_S + 2, raw.ended
        assert error is not None and error.code() == grpc.StatusCode.DEADLINE_EXCEEDED, error
        assert "grpc_idle_timeout_s" in error.details()
    finally:
        quiet.set()
        raw.close()


def test_one_peer_cannot_take_every_call(stack, expected):
    """One peer opens as many idle streams as the server runs calls: those past its cap are refused
    at once, and another peer's call is still served (on main it got RESOURCE_EXHAUSTED)."""
    base, port, _ = stack
    raw = RawCalls(port)
    attack_in_place = threading.Event()

    def victim() -> str:
        assert attack_in_place.wait(30)
        return victim_infer(port)

    try:
        with under_attack(base, victim, expected, name="gRPC calls of one peer"):
            streams = [raw.open(STREAM_INFER) for _ in range(MAX_CALLS)]
            wait_until(lambda: len(raw.ended) >= MAX_CALLS - PER_PEER, 30, "the calls past the cap ended")
            # Refused, not timed out: the calls past the cap ended first, while those within it,
            # idle and opened earlier, were all still open.
            refused = list(raw.ended)
            attack_in_place.set()
        assert sorted(refused) == streams[PER_PEER:], (streams, refused)
        wait_until(lambda: len(raw.ended) == MAX_CALLS, IDLE_TIMEOUT_S + 2, "the idle streams ended")
    finally:
        attack_in_place.set()
        raw.close()
