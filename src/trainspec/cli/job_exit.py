"""What `trainspec run` stores about the job as a whole when it fails.

A rank records its own failures (`step_failed`); a job torchrun reports failed (a rank
killed, a rank's failing exit, torchrun itself stopped by a signal) left no run-level row:
the run read as a run that merely stopped. The launcher knows the job's exit status once
every rank is gone, so it appends one `fault` event, `job_failed`, with no rank (the job's,
not a rank's), at the last step any rank of this job reached, and the status as evidence.

It is written as a segment of its own writer (`launcher`), beside the ranks', through the
store's `SegmentWriter`: nothing stored is rewritten, and a second failed job in the same
run (`--run-id`) continues that writer's sequence.
"""

from __future__ import annotations

import json
import signal
import socket
import time
from pathlib import Path
from typing import Any

JOB_WRITER = "launcher"
JOB_FAILED = "job_failed"


def failure_words(code: int) -> tuple[str, dict[str, Any]]:
    """The reason and evidence for exit status `code`, as a shell reports it (128 + N for a
    job killed by signal N, `cli.child.exit_status`)."""
    evidence: dict[str, Any] = {"exit_code": code}
    name = _signal_name(code - 128) if code > 128 else None
    if name is None:
        return f"the job exited with code {code}", evidence
    evidence["signal"] = name
    return f"the job exited with status {code} ({name})", evidence


def _signal_name(number: int) -> str | None:
    try:
        return signal.Signals(number).name
    except ValueError:
        return None


def last_step_since(run_dir: Path, started_at: float) -> int | None:
    """The last step a rank of the job started at `started_at` stored or failed in; None
    when it stored none (or the run cannot be read)."""
    try:
        import trainspec.store as store

        con = store.open(run_dir)
        try:
            row = con.execute(
                "SELECT max(step) FROM (SELECT step FROM steps WHERE ts >= $t UNION ALL "
                "SELECT step FROM events WHERE rank IS NOT NULL AND ts >= $t)",
                {"t": started_at},
            ).fetchone()
        finally:
            con.close()
    except Exception:  # noqa: BLE001 - a damaged run: the event goes in without a step
        return None
    return None if row is None or row[0] is None else int(row[0])


def record_job_failure(
    run_dir: Path, code: int, *, started_at: float, ended_at: float | None = None
) -> None:
    """Append the `job_failed` event of a job started at `started_at` (unix seconds) that
    ended with status `code` (not 0) to the run in `run_dir`. Raises `StoreError` (or
    OSError) when it cannot be written; nothing already stored is touched either way."""
    from trainspec.store import SegmentWriter
    from trainspec.store.tables import to_arrow

    reason, evidence = failure_words(code)
    evidence.update(host=socket.gethostname(), started_at=started_at)
    row: dict[str, list[Any]] = {
        "ts": [time.time() if ended_at is None else ended_at],
        "rank": [None],  # the job's, not a rank's
        "step": [last_step_since(run_dir, started_at)],
        "kind": ["fault"],
        "name": [JOB_FAILED],
        "severity": ["error"],
        "reason": [reason],
        "evidence": [json.dumps(evidence, sort_keys=True)],
    }
    SegmentWriter(run_dir, "events", JOB_WRITER).write(to_arrow("events", row))
