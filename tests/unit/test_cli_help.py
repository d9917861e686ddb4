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
