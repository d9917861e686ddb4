"""`first_line`: the one line an error is reported in, whatever its message."""

from __future__ import annotations

import pytest

from trainspec.store.errors import first_line


@pytest.mark.parametrize(
    ("exc", "want"),
    [
        (ValueError(), "ValueError"),  # str(exc).splitlines()[0] raised IndexError
        (ValueError("\n  \nsecond"), "second"),
        (OSError("disk full\nmore"), "disk full"),
        (RuntimeError("type: \x0e"), "type: \\x0e"),
    ],
)
def test_first_line(exc: BaseException, want: str) -> None:
    assert first_line(exc) == want
