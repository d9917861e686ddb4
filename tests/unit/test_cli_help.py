"""Every command says what it does in one screen, and bad input is one line with exit 2."""

from __future__ import annotations

import subprocess
import sys

import pytest

from trainspec.cli.main import COMMANDS, main


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "trainspec.cli.main", *args],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_top_level_help_lists_every_command():
    out = _run("--help")
    assert out.returncode == 0
    for name in COMMANDS:
        assert name in out.stdout


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_command_help_fits_one_screen(name, capsys):
    with pytest.raises(SystemExit) as exc:
        main([name, "--help"])
    assert exc.value.code == 0
    text = capsys.readouterr().out
    assert COMMANDS[name][1].split()[0] in text
    assert len(text.splitlines()) <= 40


def test_unknown_command_is_an_error():
    out = _run("frobnicate")
    assert out.returncode == 2
    assert "invalid choice" in out.stderr


def test_validate_without_torch_import_is_fast():
    code = "import sys; from trainspec.cli.main import main; main(['schema']); print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip().endswith("False")


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["run", "--out", "{tmp}/runs", "--", "{tmp}"], "cannot run"),  # not executable
        (["run", "--out", "{tmp}/runs", "--run-id", "../elsewhere", "--", "true"], "--run-id"),
        (["demo", "--out", "{tmp}/file"], "--out"),
        (["demo", "--out", "{tmp}/runs", "--batch-size", "0"], "--batch-size"),
        (["demo", "--out", "{tmp}/runs", "--ranks", "2", "--prometheus-port", "65535"], "65536"),
    ],
)  # fmt: skip
def test_run_and_demo_refuse_bad_input_in_one_line(argv, message, tmp_path, capsys):
    (tmp_path / "file").write_text("not a directory")
    assert main([a.replace("{tmp}", str(tmp_path)) for a in argv]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err, err


@pytest.mark.parametrize("command", ["run", "demo"])
@pytest.mark.parametrize("port", ["-1", "65536"])
def test_impossible_prometheus_ports_are_refused_before_any_rank_starts(
    command, port, tmp_path, capsys
):
    with pytest.raises(SystemExit) as exc:
        rest = ["--", "true"] if command == "run" else []
        main([command, "--out", str(tmp_path), "--prometheus-port", port, *rest])
    assert exc.value.code == 2
    assert "not a port number" in capsys.readouterr().err


def test_run_with_a_broken_config_file_is_one_line(tmp_path, capsys, monkeypatch):
    (tmp_path / "bad.toml").write_text("[store\n")
    monkeypatch.setenv("TRAINSPEC_CONFIG", str(tmp_path / "bad.toml"))
    assert main(["run", "--", "true"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "bad.toml" in err


@pytest.mark.parametrize("command", ["run", "demo"])
@pytest.mark.parametrize("out", ["", "  "])
def test_an_empty_out_is_refused_by_name(command, out, tmp_path, capsys, monkeypatch):
    """`--out ""` stored under the configured root (run) or the working directory (demo)
    without a word."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exc:
        main([command, "--out", out, *(["--", "true"] if command == "run" else [])])
    assert exc.value.code == 2
    assert "--out: an empty path" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["validate", ""], "TARGET is empty"),  # was read as ".", the current directory
        (["validate", "  "], "TARGET is empty"),
        (["schema", "--markdown", "--prometheus"], "do not combine"),  # --prometheus ignored
    ],
)
def test_arguments_that_say_nothing_are_one_line(argv, message, capsys):
    from tests.helpers.cli import one_line_error

    one_line_error(capsys, main(argv), message)
