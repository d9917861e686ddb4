"""The agent killed (SIGKILL) in the middle of a 2-rank run: training finishes, what the agent
had committed stays readable, the ranks write their own segments meanwhile (fail open), and
an agent restarted on the same port is used again."""

from __future__ import annotations

import json
import signal
import threading
import time
import urllib.request

import duckdb
import pytest

import trainspec.store as store
from tests.integration.agent_process import start_agent, stop_agent
from tests.integration.jobs import free_port, torchrun
from tests.integration.test_agent_prometheus import sidecar_env

pytestmark = pytest.mark.integration
STEPS = 200


def _status(port: int) -> dict:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/status", timeout=2) as r:
        return json.loads(r.read())


def _rows(writer_dir) -> int:
    files = sorted(writer_dir.glob("seg-*.parquet"))
    if not files:
        return 0
    listed = ", ".join(f"'{f}'" for f in files)
    return duckdb.sql(f"SELECT count(*) FROM read_parquet([{listed}])").fetchall()[0][0]


@pytest.mark.timeout(420)
def test_agent_killed_mid_run(tmp_path):
    port = free_port()
    root = tmp_path / "runs"
    agent = start_agent(root, port, log=tmp_path / "agent.log")
    # Both ranks slowed alike, so the run outlasts the agent's restart on a quiet machine too
    # (unslowed, 200 steps could end before the restarted agent was up).
    env = {
        **sidecar_env(port),
        "TRAINSPEC_AGENT_RETRY_AFTER_S": "1",
        "TRAINSPEC_INJECT": "slow:rank=0,factor=4;slow:rank=1,factor=4",
        "TRAINSPEC_ALLOW_INJECT": "1",
    }
    outcome: dict = {}

    def train() -> None:
        try:
            outcome["proc"] = torchrun(root, "killed", steps=STEPS, env=env, timeout_s=360)
        except BaseException as exc:  # reported below, on the test thread
            outcome["error"] = exc

    trainer = threading.Thread(target=train)
    trainer.start()
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and trainer.is_alive():
            try:
                if _status(port)["store"]["rows_written"] > 2000:
                    break
            except OSError:
                pass
            time.sleep(0.2)
        node = _status(port)["node"]
        agent_steps = root / "killed" / "segments" / "steps" / f"agent-{node}"
        # Everything the agent committed up to here must survive the kill.
        committed = _rows(agent_steps)
        agent.send_signal(signal.SIGKILL)
        agent.wait(10)
        time.sleep(2.0)  # the ranks notice and write locally
        agent = start_agent(root, port, log=tmp_path / "agent2.log")
        restarted_rows = 0
        while trainer.is_alive():
            restarted_rows = _status(port)["store"]["rows_written"]
            trainer.join(0.5)
    finally:
        trainer.join(360)
        stop_agent(agent)
    assert "error" not in outcome, outcome.get("error")
    assert committed > 0, "the agent committed nothing before the kill: test proves nothing"
    assert _rows(agent_steps) >= committed  # intact, nothing lost or half-written

    con = store.open(root / "killed")
    assert store.skipped_segments(con) == []  # every segment, the agent's too, reads whole
    per_rank = con.execute(
        "SELECT rank, count(DISTINCT step) FROM steps GROUP BY rank ORDER BY rank"
    ).fetchall()
    assert per_rank == [(0, STEPS), (1, STEPS)]  # the ranks wrote what the agent could not
    writers = {p.name for p in (root / "killed" / "segments" / "steps").iterdir()}
    assert {"rank-0", "rank-1", f"agent-{node}"} <= writers
    assert restarted_rows > 0, "the ranks never came back to the restarted agent"
    # At-least-once: a batch is duplicated only if the kill fell between rename and answer.
    dupes = con.execute("SELECT count(*) - count(DISTINCT (rank, step)) FROM steps").fetchall()[0][
        0
    ]
    assert dupes <= 2 * 40  # at most one flush's steps per rank
