"""Where a rank of `trainspec run` stored its run, when not where the command said.

`trainspec run --run-id outer -- torchrun ... script.py` gives every rank its run id and
runs root in the environment (`TRAINSPEC_STORE_RUN_ID`, `TRAINSPEC_STORE_ROOT`). A script
that starts trainspec itself with its own `run_id` or `run_root` stores elsewhere, and the
command's last line said "nothing stored for run outer". Such a rank leaves a note, one file
per process, in the directory the command looks in (`RUN_DIR/.elsewhere-<pid>`, holding
the directory it stored in); the command reads the notes and removes them.
"""

from __future__ import annotations

import contextlib
import logging
import os
from pathlib import Path

log = logging.getLogger("trainspec.runtime")
NOTE_PREFIX = ".elsewhere-"


def expected_run_dir() -> Path | None:
    """The run directory `trainspec run` gave this process, or None outside it."""
    env = os.environ
    root, run_id = env.get("TRAINSPEC_STORE_ROOT"), env.get("TRAINSPEC_STORE_RUN_ID")
    if "TRAINSPEC_RUN_PID" not in env or not root or not run_id:
        return None
    return Path(root) / run_id


def note_run_dir(run_dir: Path) -> None:
    """Under `trainspec run`, a session storing in `run_dir`: leave a note for the command
    where it looks, if that is elsewhere. Never raises (the command then says less)."""
    expected = expected_run_dir()
    if expected is None or os.path.abspath(run_dir) == os.path.abspath(expected):
        return
    try:
        expected.mkdir(parents=True, exist_ok=True)
        (expected / f"{NOTE_PREFIX}{os.getpid()}").write_text(os.path.abspath(run_dir))
    except OSError as exc:
        log.debug("trainspec: no note for trainspec run in %s: %s", expected, exc)


def take_notes(expected: Path) -> list[Path]:
    """The run directories the job's processes stored in instead of `expected` (in the
    order first named); the notes are removed, and `expected` too if nothing else is in it."""
    found: list[Path] = []
    if not expected.is_dir():
        return found
    for note in sorted(expected.glob(f"{NOTE_PREFIX}*")):
        with contextlib.suppress(OSError, UnicodeDecodeError):
            where = Path(note.read_text().strip())
            if where not in found:
                found.append(where)
        with contextlib.suppress(OSError):
            note.unlink()
    with contextlib.suppress(OSError):
        expected.rmdir()  # only if empty: a run stored there too stays
    return found
