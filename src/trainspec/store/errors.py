"""Typed errors of the run store."""

from __future__ import annotations


class StoreError(RuntimeError):
    """A run cannot be read or written; the message names the path and the reason."""


def first_line(exc: BaseException) -> str:
    """The first non-blank line of an error's message, printable (a damaged file's bytes can
    end up in DuckDB's words: "don't know what type: \\x0e"); the error's type name for one
    with no message (a bare `ValueError()` made `str(exc).splitlines()[0]` an IndexError)."""
    line = next((ln.strip() for ln in str(exc).splitlines() if ln.strip()), "")
    line = line or type(exc).__name__
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in line)
