"""A rank's segment writer on its own, as a process: `python merging_writer.py RUN BATCHES
ROWS FANOUT SLEEP_S` writes BATCHES samples segments of ROWS rows each, merging after every
one (a live run's writer), then writes RUN/writer-done."""

from __future__ import annotations

import sys
import time
from pathlib import Path

from trainspec.store import SegmentWriter
from trainspec.store.tables import to_arrow

SCRIPT = __file__


def main(argv: list[str]) -> None:
    run, batches, rows = Path(argv[0]), int(argv[1]), int(argv[2])
    fanout, sleep_s = int(argv[3]), float(argv[4])
    w = SegmentWriter(run, "samples", "rank-0", fanout=fanout)
    for b in range(batches):
        ts = [float(b * rows + i) for i in range(rows)]
        w.write(to_arrow("samples", {"ts": ts, "rank": [0] * rows, "metric": ["m.x"] * rows,
                                     "value": [1.0] * rows, "attrs": ["{}"] * rows}))  # fmt: skip
        w.merge()
        time.sleep(sleep_s)
    (run / "writer-done").write_text("done")


if __name__ == "__main__":
    main(sys.argv[1:])
