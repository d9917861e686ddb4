"""A writer process appends and merges while a reader process counts rows live.

The reader goes through `trainspec.store.query` only, as the dashboard and `trainspec
validate` do: counts never go down, no row is seen twice, and the final count is exact.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time

import pytest

from tests.helpers.merging_writer import SCRIPT as WRITER

BATCHES, ROWS = 300, 5

FANOUT, SLEEP_S = 4, 0.002

READER = textwrap.dedent(
    """
    import json, sys, time
    from pathlib import Path
    import trainspec.store as store
    run = Path(sys.argv[1])
    (run / "reader-ready").touch()  # imports done: the writer may start
    while not (run / "segments").exists():
        time.sleep(0.01)
    sql = "SELECT count(*) AS n, count(DISTINCT ts) AS d FROM samples"
    seen, errors = [], []
    while True:
        done = (run / "writer-done").exists()
        try:
            t = store.query(run, sql)
            seen.append((t.column("n")[0].as_py(), t.column("d")[0].as_py()))
        except Exception as exc:
            errors.append(f"{type(exc).__name__}: {exc}".splitlines()[0])
        if done:
            break
    print(json.dumps({"seen": seen, "errors": errors}))
    """
)


@pytest.mark.timeout(180)
def test_live_reader_never_sees_rows_go_down_or_twice(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    reader = subprocess.Popen(
        [sys.executable, "-c", READER, str(run)], stdout=subprocess.PIPE, text=True
    )
    # The writer starts once the reader has imported DuckDB and pyarrow: on a loaded machine
    # those imports could outlast the whole write, and the reader would see none of it.
    deadline = time.monotonic() + 60
    while not (run / "reader-ready").exists():
        assert reader.poll() is None, "the reader exited before it was ready"
        assert time.monotonic() < deadline, "the reader was not ready within 60 s"
        time.sleep(0.01)
    writer = subprocess.run(
        [sys.executable, WRITER, str(run), str(BATCHES), str(ROWS), str(FANOUT), str(SLEEP_S)],
        timeout=150,
    )
    assert writer.returncode == 0
    out, _ = reader.communicate(timeout=60)
    assert reader.returncode == 0
    result = json.loads(out)
    seen = result["seen"]
    assert not result["errors"], result["errors"][:3]
    # Overlap, stated as what it is: reads that caught the run part-way (a count of reads
    # failed on a loaded machine, 17 reads where 20 were asked, all of them part-way).
    part_way = {n for n, _ in seen if 0 < n < BATCHES * ROWS}
    assert len(part_way) >= 5, f"the reader barely overlapped the writer: {seen[:10]}"
    counts = [n for n, _ in seen]
    drops = [(a, b) for a, b in zip(counts, counts[1:]) if b < a]
    assert not drops, f"count went down: {drops[:5]}"
    assert all(n == d for n, d in seen), "a row was seen twice"
    assert seen[-1] == [BATCHES * ROWS, BATCHES * ROWS]
