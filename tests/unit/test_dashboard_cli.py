"""`trainspec dashboard`: the streamlit command it builds, and its error paths."""

from __future__ import annotations

import pytest

from trainspec.cli.dashboard import streamlit_command
from trainspec.cli.main import CliError, main


def test_options_after_the_root_pass_through(tmp_path):
    cmd, env = streamlit_command(
        str(tmp_path), ["--server.port", "8601", "--server.headless", "true"]
    )
    assert cmd[1:4] == ["-m", "streamlit", "run"] and cmd[4].endswith("dashboards/app.py")
    assert cmd[-4:] == ["--server.port", "8601", "--server.headless", "true"]
    assert env["TRAINSPEC_DASHBOARD_ROOT"] == str(tmp_path.resolve())


def test_options_without_a_root_use_runs(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs").mkdir()
    cmd, env = streamlit_command("--server.port", ["8601"])  # `dashboard -- --server.port 8601`
    assert cmd[-2:] == ["--server.port", "8601"]
    assert env["TRAINSPEC_DASHBOARD_ROOT"] == str((tmp_path / "runs").resolve())


def test_missing_root_is_a_cli_error(tmp_path):
    with pytest.raises(CliError, match="no such runs directory"):
        streamlit_command(str(tmp_path / "nope"), [])


def test_missing_root_exits_2_in_one_line(tmp_path, capsys):
    assert main(["dashboard", str(tmp_path / "nope")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"trainspec dashboard: error: {tmp_path / 'nope'}: no such runs directory"]
