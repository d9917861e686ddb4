"""Checks on what a CLI command printed."""

from __future__ import annotations


def one_line_error(capsys, code: int, *needles: str) -> str:
    """The command exited 2 with one line on stderr holding every needle; that line."""
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    assert len(err.splitlines()) == 1, err
    for needle in needles:
        assert needle in err, err
    return err
