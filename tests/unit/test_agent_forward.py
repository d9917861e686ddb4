"""OTLP forwarding upstream: delivered unchanged to a real OTLP receiver; bounded when down."""

from __future__ import annotations

import time

from tests.helpers.payloads import otlp_request
from tests.helpers.runs import synthetic_run
from tests.integration.jobs import free_port
from tests.integration.otlp_receiver import OtlpReceiver
from tests.unit.agent_fixtures import call, running_agent
from trainspec.agent.forward import Forwarder

BODY = otlp_request(synthetic_run(2, 0.2)).SerializeToString()
PROTO = {"Content-Type": "application/x-protobuf"}


def _wait(cond, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.05)
    return False


def test_ranks_otlp_reaches_upstream_unchanged(tmp_path):
    with OtlpReceiver() as upstream:
        url = f"http://127.0.0.1:{upstream.port}"
        with running_agent(tmp_path, upstream=url, nvml=False) as agent:
            for _ in range(3):
                assert call(agent.port, "POST", "/v1/metrics", BODY, PROTO)[0] == 200
            assert _wait(lambda: len(upstream.raw) == 3)
            # The receiver holds the third body before the forwarder has its reply and counts it.
            assert _wait(lambda: agent.forwarder.stats()["sent"] == 3)
        assert upstream.raw == [BODY] * 3
        assert set(upstream.metric_names_by_rank()) == {"0", "1"}


def test_down_upstream_keeps_a_bounded_buffer_and_counts_drops():
    fwd = Forwarder(f"http://127.0.0.1:{free_port()}", capacity=2, backoff_initial_s=0.05)
    fwd.start()
    for _ in range(5):
        fwd.offer(BODY, "application/x-protobuf")
    assert _wait(lambda: fwd.retries >= 2)
    stats = fwd.stats()
    fwd.close(timeout_s=2)
    assert stats["buffered"] == 2 and stats["dropped"] == 3 and stats["sent"] == 0
    assert "refused" in stats["last_error"].lower() or stats["last_error"]


def test_a_refusing_upstream_drops_instead_of_retrying_forever(tmp_path):
    # An agent with a token upstream refuses with 401: not retryable, counted as dropped.
    with running_agent(tmp_path, token="t", nvml=False) as strict:
        fwd = Forwarder(f"http://127.0.0.1:{strict.port}", capacity=10).start()
        fwd.offer(BODY, "application/x-protobuf")
        assert _wait(lambda: fwd.dropped == 1)
        fwd.close(timeout_s=2)
        assert fwd.retries == 0 and "401" in fwd.last_error


class _GarbageServer:
    """Answers every connection with a line that is no HTTP status line (BadStatusLine)."""

    def __init__(self) -> None:
        import socket
        import threading

        self.sock = socket.create_server(("127.0.0.1", 0))
        self.sock.settimeout(0.1)
        self.port = self.sock.getsockname()[1]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                continue
            with conn:
                conn.recv(65536)
                conn.sendall(b"SSH-2.0-OpenSSH_9.2\r\n")

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.sock.close()


def test_a_garbled_upstream_answer_is_retried_and_never_ends_the_thread():
    """http.client.BadStatusLine is no OSError: the forward thread died on it for good."""
    server = _GarbageServer()
    fwd = Forwarder(f"http://127.0.0.1:{server.port}", backoff_initial_s=0.01).start()
    try:
        fwd.offer(BODY, "application/x-protobuf")
        assert _wait(lambda: fwd.retries >= 3)
        assert fwd._thread is not None and fwd._thread.is_alive()
        assert "BadStatusLine" in fwd.stats()["last_error"]
        assert fwd.buffered() == 1  # kept for when upstream answers properly
    finally:
        fwd.close(timeout_s=2)
        server.close()


def test_a_request_that_cannot_be_sent_at_all_is_dropped_and_counted():
    """A URL urllib refuses (ValueError, InvalidURL) fails every time: dropped and counted,
    the thread goes on to the next request."""
    for url in ("http://[::1", "http://127.0.0.1:abc"):
        fwd = Forwarder(url, backoff_initial_s=0.01).start()
        try:
            fwd.offer(BODY, "application/x-protobuf")
            fwd.offer(BODY, "application/x-protobuf")
            assert _wait(lambda f=fwd: f.dropped == 2), fwd.stats()
            assert fwd._thread is not None and fwd._thread.is_alive()
            assert fwd.stats()["last_error"], url
        finally:
            fwd.close(timeout_s=2)
