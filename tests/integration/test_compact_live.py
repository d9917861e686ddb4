"""`trainspec compact` of a run still being written: a rank merging its segments (fanout 2,
as `TRAINSPEC_STORE_MERGE_FANOUT=2` does) deletes files between the compaction's listing and
its read. Compaction lists again and retries; it failed about 5 times in 12 with
"IO Error: No files found that match the pattern".
"""

from __future__ import annotations

import subprocess
import sys

import pytest

import trainspec.store as store
from tests.helpers.merging_writer import SCRIPT as WRITER
from trainspec.store import StoreError

pytestmark = pytest.mark.integration

BATCHES, ROWS = 300, 5

FANOUT, SLEEP_S = 2, 0.005


@pytest.mark.timeout(180)
def test_compacting_a_run_whose_writer_merges_never_fails(tmp_path):
    run = tmp_path / "run"
    (run / "segments").mkdir(parents=True)
    writer = subprocess.Popen(
        [sys.executable, WRITER, str(run), str(BATCHES), str(ROWS), str(FANOUT), str(SLEEP_S)]
    )
    done, errors = 0, []
    try:
        while not (run / "writer-done").exists() and writer.poll() is None:
            try:
                store.compact(run)
                done += 1
            except StoreError as exc:
                errors.append(str(exc))
    finally:
        assert writer.wait(timeout=120) == 0
    assert not errors, errors[:3]
    assert done >= 5, "the compactions barely overlapped the writer"
    store.compact(run)
    count = store.query(run / "run.duckdb", "SELECT count(*) FROM samples").column(0)[0]
    assert count.as_py() == BATCHES * ROWS
