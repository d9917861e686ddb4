"""A peer that hangs (SIGSTOP) must not make trainspec hold or crash the surviving rank:
its close returns at once and it exits 0, instead of waiting out the shutdown alignment
and then aborting in a telemetry thread ("terminate called without an active exception",
exit 134) as it did."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration.jobs import free_port, torchrun

SCRIPT = Path(__file__).with_name("scripts") / "hung_peer.py"


def _two_ranks(tmp_path: Path, mode: str) -> list[subprocess.Popen]:
    port = free_port()
    procs = []
    for rank in (0, 1):
        env = dict(
            os.environ,
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE="2",
            LOCAL_WORLD_SIZE="2",
            OMP_NUM_THREADS="1",
            TRAINSPEC_STORE_ROOT=str(tmp_path),
            TRAINSPEC_STORE_RUN_ID="hung",
            PG_TIMEOUT_S="5",
            PEER_FAILS=mode,
        )
        env.pop("OTEL_EXPORTER_OTLP_ENDPOINT", None)
        procs.append(
            subprocess.Popen(
                [sys.executable, str(SCRIPT)],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    return procs


@pytest.mark.timeout(120)
def test_a_hung_peer_costs_the_survivor_no_wait_and_no_crash_at_close(tmp_path):
    procs = _two_ranks(tmp_path, "stop")
    try:
        out, err = procs[0].communicate(timeout=90)
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGCONT)
                p.kill()
            p.wait()
    assert "training failed" in err, err[-2000:]
    assert procs[0].returncode == 0, f"rank 0 exited {procs[0].returncode}:\n{err[-2000:]}"
    assert "terminate called" not in err
    took = re.search(r"close took ([0-9.]+) s", out)
    assert took is not None, out
    assert float(took.group(1)) < 3.0, out  # was 10 s: the shutdown alignment's timeout


@pytest.mark.timeout(120)
def test_side_groups_wait_no_longer_than_a_training_group_the_script_made(tmp_path):
    script = Path(__file__).with_name("scripts") / "own_group_timeout.py"
    proc = torchrun(tmp_path, "own", script=script, script_args=[], timeout_s=100)
    assert "probe timeout 7" in proc.stdout and "control timeout 7" in proc.stdout, proc.stdout


@pytest.mark.timeout(120)
def test_a_rank_closing_while_its_own_error_propagates_does_not_wait_for_the_others(tmp_path):
    """Rank 1's script raises and its `finally: ts.close()` runs with the error in flight;
    rank 0 is still training (blocked in the step's all-reduce). Waiting for rank 0 at the
    shutdown alignment delayed rank 1's exit, and so torchrun's restart, by its 10 s."""
    procs = _two_ranks(tmp_path, "raise")
    try:
        out, err = procs[1].communicate(timeout=90)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
    assert "the script's own bug" in err, err[-2000:]
    assert procs[1].returncode != 0
    took = re.search(r"close took ([0-9.]+) s", out)
    assert took is not None, out + err[-2000:]
    assert float(took.group(1)) < 3.0, out  # was 10 s: the shutdown alignment's timeout
