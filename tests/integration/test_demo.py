"""The README's first command, end to end: train, store, validate, compact, summarise."""

from __future__ import annotations

import subprocess
import sys

import pytest

import trainspec.store as store


@pytest.mark.integration
@pytest.mark.timeout(400)
def test_demo_trains_validates_and_prints_the_dashboard_command(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "trainspec.cli.main", "demo", "--ranks", "2", "--steps", "40", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=380,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "COMPLIANT" in out.stdout
    assert f"trainspec dashboard {tmp_path}" in out.stdout
    (run_dir,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    assert (run_dir / "run.duckdb").is_file()
    con = store.open(run_dir / "run.duckdb")
    assert con.execute("SELECT count(*) FROM steps").fetchone()[0] == 80


@pytest.mark.integration
def test_demo_rejects_bad_arguments_in_one_line(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "trainspec.cli.main", "demo", "--steps", "0", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 2
    assert len(out.stderr.strip().splitlines()) == 1
