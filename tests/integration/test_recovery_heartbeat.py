"""Heartbeat on a real two-process gloo group: a dead rank and a hung rank are both named."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parent / "scripts" / "recovery_heartbeat.py"
SRC = Path(__file__).resolve().parents[2] / "src"

pytestmark = pytest.mark.integration


def _run_pair(mode: str, out: Path) -> dict:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for rank in (0, 1):
        env = dict(
            os.environ,
            RANK=str(rank),
            WORLD_SIZE="2",
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
        )
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(SRC), env.get("PYTHONPATH", "")]))
        procs.append(subprocess.Popen([sys.executable, str(SCRIPT), mode, str(out)], env=env))
    try:
        procs[0].wait(timeout=60)
    finally:
        for p in procs:
            p.kill()
            p.wait(timeout=10)
    return json.loads((out / "faults.json").read_text())


@pytest.mark.timeout(120)
def test_a_killed_rank_is_named_within_the_timeout(tmp_path: Path) -> None:
    report = _run_pair("kill", tmp_path)
    assert report["beats"] >= 1, "heartbeat never ran before the kill"
    fault = report["faults"][0]
    assert (fault["kind"], fault["cause"], fault["rank"], fault["detected_by"]) == (
        "fault",
        "no heartbeat",
        1,
        0,
    )
    killed_at = float((tmp_path / "killed_at").read_text())
    assert fault["t"] - killed_at < 2.0 + 0.2 + 2.0  # timeout + interval + scheduling slack


@pytest.mark.timeout(120)
def test_a_hung_rank_is_named_as_making_no_progress(tmp_path: Path) -> None:
    report = _run_pair("stall", tmp_path)
    fault = report["faults"][0]
    assert (fault["cause"], fault["rank"]) == ("no progress", 1)
    assert fault["step"] == 9 and fault["idle_s"] > 1.5
