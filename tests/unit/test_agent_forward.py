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
