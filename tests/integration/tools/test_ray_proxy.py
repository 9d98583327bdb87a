"""What the Ray Serve front (python -m tools.ray_serve) guards as start_server.py does, with one
replica of the tiny model on a local Ray instance: the API key on what the proxy answers itself
(/ray/replicas, ?replica=), and server.read_timeout_s on a request's head (Ray Serve's HTTP proxy)
and on its body (the proxy deployment)."""

import socket
import time

import httpx
import pytest

from agent_harness import LONG_ANSWERS_RUNTIME, LauncherProcess, free_ports, write_config

KEY = "ray-key"
READ_TIMEOUT_S = 1.0
RAY = {"min_replicas": 1, "max_replicas": 1, "num_cpus": 0.5, "health_check_period_s": 1}


@pytest.fixture(scope="module")
def ray_front(tmp_path_factory, tiny_llama_dir):
    port = free_ports(1)[0]
    path = write_config(
        tmp_path_factory.mktemp("ray-proxy"),
        tiny_llama_dir,
        [port],
        runtime=LONG_ANSWERS_RUNTIME,
        server={"port": port, "api_keys": [KEY], "read_timeout_s": READ_TIMEOUT_S},
        ray=RAY,
    )
    stack = LauncherProcess(path, module="tools.ray_serve", args=("--address", "local"))
    try:
        stack.wait_for("serving on http://", 300)
        yield port
    finally:
        stack.close()


def test_the_proxys_own_answers_need_the_api_key(ray_front):
    base = f"http://127.0.0.1:{ray_front}"
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        for path in ("/ray/replicas", "/metrics?replica=nope"):
            response = httpx.get(base + path, headers=headers)
            assert response.status_code == 401, (path, response.text)
            assert "replicas" not in response.text and response.headers["www-authenticate"] == "Bearer"
    listed = httpx.get(f"{base}/ray/replicas", headers={"Authorization": f"Bearer {KEY}"})
    assert listed.status_code == 200 and len(listed.json()["replicas"]) == 1, listed.text
    assert httpx.get(f"{base}/health").status_code == 200


def closed_after(connection: socket.socket, trickle: bytes, limit_s: float) -> float | None:
    """Seconds until the server closes the connection while `trickle` goes out a byte every 0.2 s
    (None: still open after limit_s)."""
    start = time.monotonic()
    connection.settimeout(0.2)
    for byte in trickle * 100:
        if time.monotonic() - start > limit_s:
            return None
        try:
            connection.send(bytes([byte]))
            if connection.recv(4096) == b"":
                return time.monotonic() - start
        except TimeoutError:
            continue
        except OSError:  # reset: closed
            return time.monotonic() - start
    return None


def test_a_head_that_trickles_in_is_cut_after_the_read_timeout(ray_front):
    with socket.create_connection(("127.0.0.1", ray_front)) as connection:
        connection.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        took = closed_after(connection, b"X-Slow: 1", limit_s=READ_TIMEOUT_S + 5)
    assert took is not None and took < READ_TIMEOUT_S + 3, took


def test_a_body_that_does_not_arrive_in_time_is_408(ray_front):
    head = (
        f"POST /models/tiny/generate HTTP/1.1\r\nHost: 127.0.0.1:{ray_front}\r\n"
        f"Authorization: Bearer {KEY}\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n"
    )
    with socket.create_connection(("127.0.0.1", ray_front)) as connection:
        connection.sendall(head.encode() + b'{"inputs": ')
        connection.settimeout(READ_TIMEOUT_S + 5)
        start = time.monotonic()
        answer = b""
        try:
            while b"}" not in answer and (chunk := connection.recv(4096)):  # to the JSON's end
                answer += chunk
        except TimeoutError:
            pass
    assert answer.startswith(b"HTTP/1.1 408"), answer
    assert b"did not arrive within 1s" in answer and time.monotonic() - start < READ_TIMEOUT_S + 3
