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
    with pytest.raises(CliError, match="nope does not exist"):
        streamlit_command(str(tmp_path / "nope"), [])


def test_missing_root_exits_2_in_one_line(tmp_path, capsys):
    assert main(["dashboard", str(tmp_path / "nope")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"trainspec dashboard: error: {tmp_path / 'nope'} does not exist"]


def _address(cmd: list[str]) -> list[str]:
    """Every value given to --server.address, in order (Streamlit takes the last)."""
    return [cmd[i + 1] for i, a in enumerate(cmd) if a == "--server.address"] + [
        a.split("=", 1)[1] for a in cmd if a.startswith("--server.address=")
    ]


@pytest.fixture
def no_streamlit_config(tmp_path, monkeypatch):
    """No STREAMLIT_SERVER_ADDRESS and no config file that names an address."""
    monkeypatch.delenv("STREAMLIT_SERVER_ADDRESS", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)


def test_listens_on_loopback_by_default(tmp_path, no_streamlit_config):
    cmd, _ = streamlit_command(str(tmp_path), ["--server.port", "8601"])
    assert _address(cmd) == ["127.0.0.1"]


@pytest.mark.parametrize("args", [["--server.address", "0.0.0.0"], ["--server.address=0.0.0.0"]])
def test_an_address_the_user_gives_is_the_only_one(tmp_path, no_streamlit_config, args):
    cmd, _ = streamlit_command(str(tmp_path), args)
    assert _address(cmd) == ["0.0.0.0"]


def test_an_address_from_streamlits_variable_is_kept(tmp_path, no_streamlit_config, monkeypatch):
    monkeypatch.setenv("STREAMLIT_SERVER_ADDRESS", "0.0.0.0")
    cmd, env = streamlit_command(str(tmp_path), [])
    assert _address(cmd) == [] and env["STREAMLIT_SERVER_ADDRESS"] == "0.0.0.0"


def test_an_address_from_streamlits_config_file_is_kept(tmp_path, no_streamlit_config):
    (tmp_path / ".streamlit").mkdir()
    (tmp_path / ".streamlit" / "config.toml").write_text('[server]\naddress = "0.0.0.0"\n')
    cmd, _ = streamlit_command(str(tmp_path), [])
    assert _address(cmd) == []


def test_help_says_where_it_listens(capsys):
    with pytest.raises(SystemExit):
        main(["dashboard", "--help"])
    assert "127.0.0.1" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["--server.port", "99999"], "--server.port 99999: must be a port in 1-65535"),
        (["--server.port=-1"], "--server.port -1: must be a port in 1-65535"),
        (["--server.address", "999.1.1.1"], "--server.address 999.1.1.1: not an address here"),
    ],
)
def test_a_port_or_address_streamlit_cannot_bind_is_one_line(tmp_path, capsys, args, words):
    """Streamlit's own traceback (OverflowError, gaierror) and exit 1 before."""
    assert main(["dashboard", str(tmp_path), *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and words in err[0]
