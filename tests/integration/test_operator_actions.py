"""An operator's `POST /v1/actions` to the node agent reaches every rank at the same step."""

from __future__ import annotations

import json
import urllib.request

import pytest

import trainspec.store as store
from tests.integration.agent_process import start_agent, stop_agent
from tests.integration.jobs import free_port, torchrun


@pytest.mark.integration
@pytest.mark.timeout(300)
def test_set_compression_reaches_every_rank_at_one_step(tmp_path):
    port = free_port()
    agent = start_agent(tmp_path / "agent-store", port)
    try:
        body = json.dumps({"action": "set_compression", "level": "int8"}).encode()
        req = urllib.request.Request(
            f"http://127.0.0.1:{port}/v1/actions",
            data=body,
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=5) as r:
            assert r.status in (200, 201, 202)
        torchrun(
            tmp_path, "ops", steps=30, env={"TRAINSPEC_AGENT_ENDPOINT": f"http://127.0.0.1:{port}"}
        )
    finally:
        stop_agent(agent)
    con = store.open(tmp_path / "ops")
    first_int8 = con.execute(
        "SELECT rank, min(step) FROM steps WHERE compression = 'int8' GROUP BY rank ORDER BY rank"
    ).fetchall()
    assert len(first_int8) == 2 and first_int8[0][1] == first_int8[1][1], first_int8
    switch = first_int8[0][1]
    before = con.execute(f"SELECT DISTINCT compression FROM steps WHERE step < {switch}").fetchall()
    assert before == [("none",)]
    events = con.execute(
        "SELECT rank, step FROM events WHERE kind = 'action' AND name = 'operator' ORDER BY rank"
    ).fetchall()
    assert [r for r, _ in events] == [0, 1] and events[0][1] == events[1][1]
