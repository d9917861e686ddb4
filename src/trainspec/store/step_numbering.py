"""Warnings about a run's step numbers: steps a rank stored twice, or not at all, at its
start, in its middle or at its end, where no restart, failure or uneven input explains it.

Read by the validator's run reader (`store/target.py`); each is a warning (`--strict` fails
on it), not a violation: the rows that are there are judged as they are.
"""

from __future__ import annotations

from typing import Any

from trainspec.schema.targets.model import TargetData

# Runs of consecutive step numbers a rank stored more than once / not at all. A row older
# than a `checkpoint loaded` event of its rank, at a step from the one loaded on, is the
# earlier attempt's (the restarted job ran that step again): expected, not counted. So is a
# row older than the start of a process of its rank that torchrun restarted (`restart` in its
# runs row's config) and that found no checkpoint, when that process stored the step again:
# it ran every step again from 0 (it was warned as "two jobs under one run id").
_REPEATED_STEPS_SQL = """
WITH loads AS (SELECT rank, ts, TRY_CAST(CASE WHEN json_valid(evidence)
                    THEN json_extract_string(evidence, '$.step') END AS BIGINT) AS from_step
               FROM events WHERE kind = 'checkpoint' AND name = 'loaded'),
     restarts AS (SELECT rank, started_at FROM runs
                  WHERE TRY_CAST(CASE WHEN json_valid(config)
                      THEN json_extract_string(config, '$.restart') END AS BIGINT) > 0),
     o AS (SELECT rank, step, ts,
                  row_number() OVER (PARTITION BY rank, step ORDER BY ts DESC) AS newer,
                  max(ts) OVER (PARTITION BY rank, step) AS latest
           FROM steps WHERE step IS NOT NULL),
     d AS (SELECT rank, step, count(*) AS extra FROM o WHERE newer > 1 AND NOT EXISTS (
               SELECT 1 FROM loads l
               WHERE l.rank = o.rank AND l.from_step <= o.step AND l.ts > o.ts)
           AND NOT EXISTS (
               SELECT 1 FROM restarts s
               WHERE s.rank = o.rank AND s.started_at > o.ts AND s.started_at <= o.latest)
           GROUP BY rank, step),
     r AS (SELECT *, step - row_number() OVER (PARTITION BY rank ORDER BY step) AS run FROM d)
SELECT rank, min(step), max(step), sum(extra) FROM r GROUP BY rank, run ORDER BY rank, 2
"""
# Each rank's step numbers: its rows', and those of steps whose body raised (a failed step
# keeps its number and stores no row).
_NUMBERED_STEPS = """
s AS (SELECT DISTINCT rank, step FROM steps WHERE step IS NOT NULL
      UNION
      SELECT rank, step FROM events WHERE kind = 'fault' AND name = 'step_failed'
                                    AND rank IS NOT NULL AND step IS NOT NULL)"""
_MISSING_STEPS_SQL = f"""
WITH {_NUMBERED_STEPS},
     n AS (SELECT rank, step, lead(step) OVER (PARTITION BY rank ORDER BY step) AS next FROM s)
SELECT rank, step + 1, next - 1 FROM n WHERE next > step + 1 ORDER BY rank, 2
"""
# A rank whose last step is before the last step other ranks stored a row for (ranks with a
# process group step together): a killed rank's last rows lost even to its journal, which
# `--strict` did not catch since the gap is at the end of its own steps. Not a rank whose
# end is on record: its last step failed (`step_failed`: the peers' later steps, which a
# rank that died after its backward lets them finish, were never its), or its data ran out
# under DDP's join (`uneven_inputs`, at or after its last step: it ran fewer steps). A
# step that failed on some rank is no step another rank lost (a rank that raised after its
# last step, in an evaluation, failed at a step none stored).
_ENDED = """((kind = 'fault' AND name = 'step_failed')
             OR (kind = 'anomaly' AND name = 'uneven_inputs'))"""
_SHORT_TAIL_SQL = f"""
WITH {_NUMBERED_STEPS},
     alone AS (SELECT DISTINCT rank FROM runs WHERE json_valid(config)
                   AND json_extract(config, '$.process_group') = 'false'::JSON),
     last AS (SELECT rank, max(step) AS last FROM s
              WHERE rank NOT IN (SELECT rank FROM alone) GROUP BY rank),
     ended AS (SELECT rank, max(step) AS at FROM events
               WHERE {_ENDED} AND rank IS NOT NULL AND step IS NOT NULL GROUP BY rank),
     top AS (SELECT max(step) AS top FROM steps WHERE rank NOT IN (SELECT rank FROM alone))
SELECT last.rank, last + 1, top FROM last CROSS JOIN top
LEFT JOIN ended ON ended.rank = last.rank
WHERE last < top AND (ended.at IS NULL OR ended.at < last) ORDER BY last.rank
"""
# A rank whose first step is after the first step other ranks stored (ranks with a process
# group step together, from the first step on): the first rows of a rank lost (a deleted or
# unreadable first segment), which `--strict` did not catch since no gap lies between its own
# stored steps. Judged against the other ranks, not step 0: a job resumed from a checkpoint
# starts at the checkpoint's step on every rank alike (every rank loads the same one), so its
# run starts at N everywhere; ranks measured each on its own need not start together. Nor a
# rank that loaded a checkpoint at or before its first step: a job resumed under the same run
# id with more ranks (scaled up) starts its new ranks at the checkpoint's step.
_SHORT_HEAD_SQL = f"""
WITH {_NUMBERED_STEPS},
     alone AS (SELECT DISTINCT rank FROM runs WHERE json_valid(config)
                   AND json_extract(config, '$.process_group') = 'false'::JSON),
     head AS (SELECT rank, min(step) AS head FROM s
              WHERE rank IS NOT NULL AND rank NOT IN (SELECT rank FROM alone) GROUP BY rank),
     loads AS (SELECT rank, TRY_CAST(CASE WHEN json_valid(evidence)
                    THEN json_extract_string(evidence, '$.step') END AS BIGINT) AS from_step
               FROM events WHERE kind = 'checkpoint' AND name = 'loaded'),
     low AS (SELECT min(head) AS low FROM head)
SELECT head.rank, low, head - 1 FROM head CROSS JOIN low WHERE head > low
AND NOT EXISTS (SELECT 1 FROM loads WHERE loads.rank = head.rank AND loads.from_step <= head)
ORDER BY head.rank
"""
_RANGES_SHOWN = 5


def _ranges(rows: list[tuple], label: Any) -> dict[Any, str]:
    """Per rank, its step ranges as text ("96-102 (7 extra rows)"), at most a few shown."""
    out: dict[Any, list[str]] = {}
    for row in rows:
        out.setdefault(row[0], []).append(label(*row[1:]))
    return {
        rank: ", ".join(texts[:_RANGES_SHOWN])
        + (f" and {len(texts) - _RANGES_SHOWN} more" if len(texts) > _RANGES_SHOWN else "")
        for rank, texts in out.items()
    }


def _span(first: int, last: int) -> str:
    return f"step {first}" if first == last else f"steps {first}-{last}"


def read_step_numbering(con, data: TargetData) -> None:
    """Warn where a rank's steps are not each stored once, and no restart explains it (a
    restart from a checkpoint runs the steps after it again: both attempts' rows stay, the
    earlier ones older than the `checkpoint loaded` event); a process killed before its
    flush loses its last rows, and a rank whose first rows are gone starts after its peers."""
    repeated = _ranges(
        con.execute(_REPEATED_STEPS_SQL).fetchall(),
        lambda a, b, extra: f"{_span(a, b)} ({extra} extra row{'s' * (extra != 1)})",
    )
    for rank, text in repeated.items():
        data.warnings.append(
            f"rank {rank}: stored more than once: {text} (no checkpoint was loaded after "
            "the earlier rows: two jobs under one run id, or rows written twice)"
        )
    for rank, first, last in con.execute(_SHORT_HEAD_SQL).fetchall():
        data.warnings.append(
            f"rank {rank}: no row for {_span(first, last)}, which other ranks stored before "
            "its first row (the first rows of a process lost or dropped)"
        )
    missing = _ranges(con.execute(_MISSING_STEPS_SQL).fetchall(), _span)
    for rank, text in missing.items():
        data.warnings.append(
            f"rank {rank}: no row for {text} (rows a killed process had not flushed, or dropped)"
        )
    for rank, first, last in con.execute(_SHORT_TAIL_SQL).fetchall():
        data.warnings.append(
            f"rank {rank}: no row for {_span(first, last)}, which other ranks stored (the last "
            "rows of a process that was killed, or of a run still being written)"
        )
