"""The run, or directory of runs, a command-line argument names; one line saying why not.

Every command that takes a run or runs path refuses a path it cannot use with one of three
lines: `<path> does not exist`, `<path> is not a directory`, or `<path> is not a trainspec
run (no ...)`. A run's store file, `RUN/run.duckdb`, names its run whether the run was
compacted yet or not: the file a user sees in a run directory, or guesses from the docs,
is as good as the directory (`query`, `validate`, `report`, `compact`, `dashboard`).
"""

from __future__ import annotations

from pathlib import Path

from trainspec.cli.main import CliError
from trainspec.store.layout import COMPACT_NAME, is_run_dir


def run_of_store_file(path: Path) -> Path | None:
    """The run directory `path` is the store file of (`RUN/run.duckdb` of a run, compacted
    or not), or None. The directory, not the file: before compaction the file does not
    exist, and after it the directory reads the file's rows plus any segment written since
    (a restarted job appends to a compacted run)."""
    if path.name == COMPACT_NAME and is_run_dir(path.parent):
        return path.parent
    return None


def existing_directory(text: str) -> Path:
    """`text` as a directory that exists (a runs root, or a run's directory); CliError
    saying which of the two it is not."""
    path = Path(text)
    run_dir = run_of_store_file(path)
    if run_dir is not None:
        return run_dir
    if not path.exists():
        raise CliError(f"{path} does not exist")
    if not path.is_dir():
        raise CliError(f"{path} is not a directory")
    return path


def run_location(text: str) -> Path:
    """What a reader opens for the run `text` names: a run directory, or a compacted
    `.duckdb` file on its own (copied out of its run, say). CliError in one line otherwise."""
    path = Path(text)
    if path.suffix == ".duckdb" and path.is_file() and run_of_store_file(path) is None:
        return path
    run_dir = existing_directory(text)
    if not is_run_dir(run_dir):
        raise CliError(f"{run_dir} is not a trainspec run (no segments/ and no {COMPACT_NAME})")
    return run_dir
