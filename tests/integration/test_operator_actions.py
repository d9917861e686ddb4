"""An operator's `POST /v1/actions` to the node agent reaches every rank at the same step."""

from __future__ import annotations

import json
import urllib.request

import pytest

import trainspec.store as store
from tests.integration.agent_process import start_agent, stop_agent
from tests.integration.jobs import free_port, torchrun
from trainspec.runtime import checkpoint_layout as layout


def _post(port: int, action: dict) -> None:
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/actions",
        data=json.dumps(action).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=5) as r:
        assert r.status in (200, 201, 202)


@pytest.mark.integration
@pytest.mark.timeout(300)
def test_set_compression_reaches_every_rank_at_one_step(tmp_path):
    port = free_port()
    agent = start_agent(tmp_path / "agent-store", port)
    try:
        _post(port, {"action": "set_compression", "level": "int8"})
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


@pytest.mark.integration
@pytest.mark.timeout(300)
def test_a_checkpoint_asked_before_a_level_switch_saves_the_level_the_next_step_runs(tmp_path):
    """QA operator.sh / op_resume.sh: `checkpoint` and then `set_compression lowrank:2`,
    applied at one boundary, saved the old level: the job resumed from that checkpoint ran
    the wrong level until the next switch."""
    port = free_port()
    agent = start_agent(tmp_path / "agent-store", port)
    ckpt = tmp_path / "ckpt"
    try:
        _post(port, {"action": "checkpoint"})
        _post(port, {"action": "set_compression", "level": "lowrank:2"})
        # The default model: a smaller one ran its 20 steps before the client's first poll.
        args = ["--steps=40", "--batch-size=8", f"--ckpt-dir={ckpt}"]
        env = {"TRAINSPEC_AGENT_ENDPOINT": f"http://127.0.0.1:{port}"}
        torchrun(tmp_path, "opck", env=env, script_args=args, timeout_s=240)
    finally:
        stop_agent(agent)
    con = store.open(tmp_path / "opck")
    switch = con.execute("SELECT min(step) FROM steps WHERE compression = 'lowrank:2'").fetchone()
    assert switch[0] is not None
    operator = [c for c in layout.committed_newest_first(ckpt)
                if layout.read_manifest(c)["reason"] == "operator"]  # fmt: skip
    assert len(operator) == 1 and operator[0].step == switch[0], (operator, switch)
    for rank in (0, 1):
        extra = json.loads(layout.extra_path(operator[0].path, rank).read_text())
        assert extra["trainspec"]["actuator"]["compression"]["level"] == "lowrank:2"
