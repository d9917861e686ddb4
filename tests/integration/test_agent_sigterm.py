"""A planned agent restart (SIGTERM) while a batch waits for its group commit: the final
commit stores it and the rank hears 200 before the process exits, so it is stored once. The
rank used to get a dropped connection and write the batch again itself (duplicates)."""

from __future__ import annotations

import http.client
import json
import signal
import time
import urllib.request

import pytest

import trainspec.store as store
from tests.integration.agent_process import start_agent, stop_agent
from tests.integration.jobs import free_port
from tests.unit.test_agent_ingest import _batch_body, _batch_headers

pytestmark = pytest.mark.integration


@pytest.mark.timeout(90)
def test_sigterm_answers_the_batches_its_final_commit_stored(tmp_path):
    port = free_port()
    env = {"TRAINSPEC_AGENT_COMMIT_INTERVAL_S": "20"}  # the batch waits; SIGTERM commits it
    proc = start_agent(tmp_path, port, "--no-nvml", env=env, log=tmp_path / "agent.log")
    try:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=20)
        headers = {**_batch_headers("term", "0"), "X-Trainspec-Batch": "t-1",
                   "X-Trainspec-Deadline": f"{time.time() + 15:.3f}"}  # fmt: skip
        conn.request("POST", "/v1/trainspec/batches", _batch_body(0), headers)
        _wait_until_queued(port)
        proc.send_signal(signal.SIGTERM)
        resp = conn.getresponse()
        assert (resp.status, resp.read()) == (200, b'{"rows": 5}\n')
        assert proc.wait(20) == 0
    finally:
        stop_agent(proc)
    con = store.open(str(tmp_path / "term"))
    assert con.execute("SELECT count(*) FROM samples").fetchone()[0] == 5


def _wait_until_queued(port: int, timeout_s: float = 20.0) -> None:
    """Until the agent holds the batch for its next commit (a fixed sleep was short on a
    loaded machine: a batch read after SIGTERM gets a 503)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/status", timeout=5) as r:
            if json.load(r)["store"]["pending_rows"] > 0:
                return
        time.sleep(0.05)
    raise AssertionError("the batch never reached the agent's queue")
