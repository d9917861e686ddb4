"""The agent's HTTP server: address families, bodies on any method, answers at shutdown."""

from __future__ import annotations

import http.client
import socket
import threading
import time

import pytest

from tests.unit.agent_fixtures import call, running_agent


def _ipv6_loopback() -> bool:
    if not socket.has_ipv6:
        return False
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


@pytest.mark.skipif(not _ipv6_loopback(), reason="no IPv6 loopback on this machine")
def test_an_ipv6_listen_address_binds_and_serves(tmp_path):
    """ "[::1]:PORT" passed the settings and then failed to bind (the server was AF_INET)."""
    with running_agent(tmp_path, listen="[::1]:0", nvml=False) as agent:
        conn = http.client.HTTPConnection("::1", agent.port, timeout=10)
        try:
            conn.request("GET", "/healthz")
            assert conn.getresponse().status == 200
        finally:
            conn.close()


def _answers(sock: socket.socket, count: int) -> list[bytes]:
    """The status lines of the next `count` answers on a raw connection."""
    reader = sock.makefile("rb")
    out = []
    for _ in range(count):
        status = reader.readline()
        length = 0
        while (line := reader.readline()) not in (b"\r\n", b""):
            if line.lower().startswith(b"content-length:"):
                length = int(line.split(b":")[1])
        reader.read(length)
        out.append(status.strip())
    return out


def test_a_body_on_a_get_is_read_not_taken_for_the_next_request(tmp_path):
    """The body of a GET was left unread and parsed as the next request on the connection."""
    smuggled = b"GET /nowhere HTTP/1.1\r\nHost: x\r\n\r\n"
    with (
        running_agent(tmp_path, nvml=False) as agent,
        socket.create_connection(("127.0.0.1", agent.port), timeout=10) as sock,
    ):
        sock.sendall(
            b"GET /healthz HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s"
            % (len(smuggled), smuggled)
            + b"GET /readyz HTTP/1.1\r\nHost: x\r\n\r\n"
        )
        assert _answers(sock, 2) == [b"HTTP/1.1 200 OK"] * 2
        assert agent.counters.snapshot()["rejected"] == {}  # no 404 for /nowhere


def test_a_body_on_a_get_past_the_limit_is_refused_and_the_connection_closed(tmp_path):
    with running_agent(tmp_path, nvml=False, max_body_bytes=16) as agent:
        status, raw = call(agent.port, "GET", "/healthz", b"x" * 17)
        assert status == 413, raw


def test_a_shutdown_answers_the_batches_its_final_commit_stored(tmp_path):
    """SIGTERM: close() committed the waiting batch, then returned before the request thread
    (a daemon) answered; the process exited and the rank, without an answer, wrote the batch
    again. close() now returns once those answers are sent (the real process:
    tests/integration/test_agent_sigterm.py)."""
    from tests.unit.test_agent_ingest import _batch_body, _batch_headers

    answers: list[int] = []
    with running_agent(tmp_path, commit_interval_s=30.0, nvml=False) as agent:
        conn = http.client.HTTPConnection("127.0.0.1", agent.port, timeout=20)
        sent = threading.Event()

        def post() -> None:
            headers = {**_batch_headers("closing", "0"), "X-Trainspec-Batch": "c-1"}
            conn.request("POST", "/v1/trainspec/batches", _batch_body(0), headers)
            sent.set()
            answers.append(conn.getresponse().status)

        thread = threading.Thread(target=post, daemon=True)
        thread.start()
        assert sent.wait(10)
        deadline = time.monotonic() + 10
        while agent.store.pending() == 0 and time.monotonic() < deadline:
            time.sleep(0.01)  # queued for the (30 s away) commit
        # Slow the answer down: without the drain, close() returns before it is sent.
        original = agent.server.RequestHandlerClass._answer  # type: ignore[attr-defined]

        written: list[int] = []

        def slow_answer(self, resp):  # type: ignore[no-untyped-def]
            time.sleep(0.5)
            original(self, resp)
            written.append(resp.status)

        agent.server.RequestHandlerClass._answer = slow_answer  # type: ignore[attr-defined]
        agent.close()
        assert written == [200]  # sent before close() returned
        thread.join(5)
        conn.close()
    assert answers == [200]


@pytest.mark.parametrize(
    "framing",
    [
        b"Content-Length: 2\r\nContent-Length: 50\r\n",
        b"Content-Length: 2\r\nContent-Length: 2\r\n",
        b"Content-Length: 2\r\nTransfer-Encoding: chunked\r\n",
    ],
)
def test_a_body_framed_two_ways_is_refused_and_the_connection_closed(tmp_path, framing):
    """Two Content-Length headers (or one beside Transfer-Encoding): the first had been used
    and the connection kept, so a proxy reading the other framing saw a different next
    request (smuggling)."""
    with (
        running_agent(tmp_path, nvml=False) as agent,
        socket.create_connection(("127.0.0.1", agent.port), timeout=10) as sock,
    ):
        sock.sendall(
            b"POST /v1/metrics HTTP/1.1\r\nHost: x\r\n%sContent-Type: application/json\r\n\r\n{}"
            % framing
            + b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n"
        )
        reader = sock.makefile("rb")
        assert reader.readline().strip() == b"HTTP/1.1 400 Bad Request"
        head = []
        while (line := reader.readline()) not in (b"\r\n", b""):
            head.append(line.strip().lower())
        assert b"connection: close" in head
        length = next(int(h.split(b":")[1]) for h in head if h.startswith(b"content-length"))
        reader.read(length)
        assert reader.readline() == b""  # closed: the rest is never read as a request
        assert agent.counters.snapshot()["rejected"] == {"length": 1}
