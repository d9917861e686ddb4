"""The compliance validator: judge a target's statistics against the catalogue.

Rules (each violation names the metric, the rank, the rule and the evidence):
- `rank-present`: every rank the run's world size promises reported something.
- `required`: every metric required for a rank is present there (GPU metrics only where the
  rank had GPUs, allocator metrics only on CUDA, `distributed` ones only when world_size > 1
  and the rank had a process group: a run's ranks measured each on its own, with none, never
  communicate, though every rank the world size promises must still report)
  and, for per-step metrics, present on every step, except steps where the catalogue says
  the value does not exist (`undefined_when`: the noise scale while its |G|^2 EMA is not
  positive) or, checked per step, where an event marks that step (`absent_with_event`: a
  `nonfinite_gradients` anomaly for the gradient norm and variance), or where fewer ranks
  trained on samples than the metric needs (`needs_ranks_with_samples`: the variance across
  ranks on a step where one rank's share was 0).
- `coverage`: a required series covers its rank's span to within `COVERAGE_TOLERANCE`
  intervals, and at least `COVERAGE_FLOOR_S`, at each edge (a stored run: each process's training loop, or its samples where it
  has no steps, `store/target.py`; a payload: its rank's resource's first to last point): a
  sampler that started late or stopped early left no gap between points for cadence to see.
- `cadence`: the 95th percentile of the real gaps between a series' points is at most the
  catalogue interval times `CADENCE_TOLERANCE` (a stored run: over each process's training
  loop, so a restarted rank's restart is no gap, `store/target.py`; an OTLP payload: over
  each process's stream, a cumulative point with a new start time beginning one,
  `targets.model.summarize`; against at least the export interval that the points' times
  show, `TargetData.export_interval_s`: an export carries one point per series). A series
  is one resource's (OTLP: every resource attribute
  counts), so two runs or processes that claim one rank are never merged.
- `name`, `unit`, `instrument`, `attribute`, `resource-attribute`: what the target declares
  matches the catalogue (a Prometheus counter's samples end in `_total`); every series
  carries the catalogue's resource attributes and its required attributes (an empty value is
  none), rank, local rank and world size as integers in range, the ranks below the world
  size, one world size per run (`targets/resources.py`) (a node's own GPU and host series, with
  neither a run id nor a rank, only service.name and host.name; they belong to no rank, so
  a node agent's endpoint with no rank behind it has no `required` metric).
- `monotonic`: cumulative counters never go down (points of one time in arrival order; a
  restarted rank's new process starts them again from 0: a new runs row, a new OTLP start
  time).
- `duplicate`: a series has one value at a time: not reported twice with different values
  in one exposition, or at one timestamp in a payload or run.
- `finite`, `range`: no NaN or infinity; values within the catalogue's range (ratios in 0..1,
  byte counts never negative), and no histogram bucket bound below the range's minimum.
- `time`: every stored point (and OTLP data point) has a finite time (a NULL or NaN `ts` can be neither placed nor
  judged for cadence, which skipped such series without a word).
- `event`: events have a known kind, a reason, and JSON evidence (strict: no NaN or Infinity).
"""

from __future__ import annotations

import json

from trainspec.schema.catalogue import Catalogue, Metric, load_catalogue
from trainspec.schema.targets import read_target
from trainspec.schema.targets.model import RankInfo, SeriesStats, TargetData, is_blank
from trainspec.schema.verdict import Report, Violation

# A p95 gap up to 1.5 intervals passes: sampling threads are scheduled by the OS and flushes
# pause them briefly; a sampler running at half its rate (2 intervals) fails.
CADENCE_TOLERANCE = 1.5
# A required series may start up to 2.5 intervals after its rank's span starts and end up to
# 2.5 before it ends, and never less than 1 s: a sampler's first reading waits for its first
# tick (a rate for its second), and its last is taken as it closes; one that started late or
# stopped early by more fails. The floor: a 50 ms series' edge is as exposed as any gap of it
# to one stall of a loaded host, which cadence's p95 forgives inside the span (a max gap of
# 6.5 s was seen there), and the latency probe needs its peer, which may close its session
# first: a 2-rank zero-code test failed 1 run in 4 under a bare 2.5 intervals (the probe's
# last point 0.139 s before the loop's end, 2026-11-28). A sampler that died is seconds off.
COVERAGE_TOLERANCE = 2.5
COVERAGE_FLOOR_S = 1.0
# Units whose values can never be negative or exceed 1, whatever the catalogue's range says.
_UNIT_BOUNDS: dict[str, tuple[float | None, float | None]] = {
    "1": (0.0, 1.0),
    "By": (0.0, None),
    "s": (0.0, None),
}


def is_required(metric: Metric, info: RankInfo, world_size: int) -> bool:
    rule = {
        "always": True,
        "gpu": info.gpu,
        "cuda": info.cuda,
        "distributed": world_size > 1 and info.communicates,
        "optional": False,
    }
    return rule[metric.required_when]


def _fmt(x: float) -> str:
    return f"{x:.4g}"


ABSENT_LISTED = 32  # absent ranks listed one by one; the rest are counted in one line


def _check_ranks(data: TargetData, by_rank: dict, out: list[Violation]) -> set:
    absent = {rank for rank in data.ranks if rank not in by_rank}
    ordered = sorted(absent, key=lambda r: -1 if r is None else r)
    for rank in ordered[:ABSENT_LISTED]:
        out.append(
            Violation(
                "*",
                rank,
                "rank-present",
                f"no data at all from this rank (world size {data.world_size})",
            )
        )
    if len(ordered) > ABSENT_LISTED:
        rest = ordered[ABSENT_LISTED:]
        out.append(
            Violation(
                "*",
                None,
                "rank-present",
                f"{len(rest)} more ranks ({rest[0]} to {rest[-1]}) sent no data at all "
                f"(world size {data.world_size})",
            )
        )
    return absent


def _check_required(catalogue, data: TargetData, by_rank: dict, out: list[Violation]) -> None:
    for rank, info in data.ranks.items():
        if rank not in by_rank:
            continue
        for metric in catalogue:
            if metric.store_table == "events" or not is_required(metric, info, data.world_size):
                continue
            series = by_rank[rank].get(metric.name, [])
            valued = sum(s.count - s.nulls for s in series)
            if series and metric.undefined_when:
                continue  # reported where it exists; steps without a value are allowed
            if not series or valued == 0:
                why = f"required ({metric.required_when}) but absent"
                if series:
                    why = (
                        f"required ({metric.required_when}) but empty on all {series[0].count} rows"
                    )
                out.append(Violation(metric.name, rank, "required", why))
                continue
            for s in series:
                _check_coverage(metric, s, data, out)
            if metric.interval == "step":
                empty = sum(s.nulls for s in series)
                if empty:
                    total = sum(s.count for s in series)
                    out.append(
                        Violation(
                            metric.name,
                            rank,
                            "cadence",
                            f"no value on {empty} of {total} steps (interval: every step)",
                        )
                    )


def _judged_interval(metric: Metric, data: TargetData) -> tuple[float | None, str]:
    """The interval a series' gaps are judged against, and "export " where it is the
    export interval: an export cannot show a shorter one. (From two exports, the one gap is
    the export interval itself, so cadence passes whatever it is: a note says so.)"""
    interval, export = metric.interval_s, data.export_interval_s
    if interval is not None and export is not None and export > interval:
        return export, "export "
    return interval, ""


def _check_coverage(metric: Metric, s: SeriesStats, data: TargetData, out: list[Violation]) -> None:
    """A required series covers its rank's span (`TargetData.span`) to within
    `COVERAGE_TOLERANCE` intervals (at least `COVERAGE_FLOOR_S`) at each edge: cadence judges the gaps between its points,
    this the gaps before its first and after its last (a sampler started late or stopped
    early left both unjudged)."""
    interval, which = _judged_interval(metric, data)
    if not data.timed or interval is None:
        return
    limit = max(interval * COVERAGE_TOLERANCE, COVERAGE_FLOOR_S)
    allowed = (
        f"{_fmt(limit)} s ({which}interval {_fmt(interval)} s x {COVERAGE_TOLERANCE}, at least "
        f"{_fmt(COVERAGE_FLOOR_S)} s) allowed"
    )
    for gap, where in ((s.head_gap_s, "after the start"), (s.tail_gap_s, "before the end")):
        if gap is not None and gap > limit:
            edge = "first" if where.startswith("after") else "last"
            out.append(
                Violation(
                    metric.name,
                    s.rank,
                    "coverage",
                    f"{edge} point {_fmt(gap)} s {where} of {data.span}, {allowed}{_attrs_note(s)}",
                )
            )


def _check_series(metric: Metric, s: SeriesStats, data: TargetData, out: list[Violation]) -> None:
    def add(rule: str, evidence: str) -> None:
        out.append(Violation(metric.name, s.rank, rule, evidence))

    interval, which = _judged_interval(metric, data)
    if data.timed and interval is not None and s.p95_gap_s is not None:
        limit = interval * CADENCE_TOLERANCE
        if s.p95_gap_s > limit:
            add(
                "cadence",
                f"p95 gap {_fmt(s.p95_gap_s)} s (max {_fmt(s.max_gap_s or 0)} s) over "
                f"{s.count} points > {_fmt(limit)} s ({which}interval {_fmt(interval)} s x "
                f"{CADENCE_TOLERANCE}){_attrs_note(s)}",
            )
    if s.attrs_error:
        add("attribute", s.attrs_error)
    else:
        # An empty value is no value: Prometheus reads a label set to "" as one not set.
        missing = [
            a if s.attrs.get(a) is None else f"{a} (empty value)"
            for a in metric.required_attributes
            if s.attrs.get(a) is None or is_blank(s.attrs[a])
        ]
        if missing:
            add("attribute", f"missing {', '.join(missing)} on series {json.dumps(s.attrs)}")
    if s.nonfinite:
        add("finite", f"{s.nonfinite} of {s.count} values are NaN or infinite{_attrs_note(s)}")
    if s.untimed:
        add("time", f"{s.untimed} of {s.count} points have no finite time{_attrs_note(s)}")
    if s.cumulative and s.decreases:
        add(
            "monotonic",
            f"counter went down {s.decreases} times (largest drop {_fmt(s.largest_drop or 0)})"
            f"{_attrs_note(s)}",
        )
    if s.conflicts:
        add(
            "duplicate",
            f"{s.conflicts} more value{'s' * (s.conflicts != 1)} at a time the series already "
            f"has one (one series reported twice with different values){_attrs_note(s)}",
        )
    lo, hi = _bounds(metric)
    if lo is not None and s.minimum is not None and s.minimum < lo:
        add("range", f"minimum {_fmt(s.minimum)} < {_fmt(lo)}{_attrs_note(s)}")
    if hi is not None and s.maximum is not None and s.maximum > hi:
        add("range", f"maximum {_fmt(s.maximum)} > {_fmt(hi)}{_attrs_note(s)}")
    if lo is not None and s.lowest_bound is not None and s.lowest_bound < lo:
        add(
            "range",
            f"histogram bucket bound {_fmt(s.lowest_bound)} < {_fmt(lo)}, below any value the "
            f"metric can take{_attrs_note(s)}",
        )


def _attrs_note(s: SeriesStats) -> str:
    note = f" on {json.dumps(s.attrs, sort_keys=True)}" if s.attrs else ""
    return note + (f" (resource {s.origin})" if s.origin else "")


def _bounds(metric: Metric) -> tuple[float | None, float | None]:
    lo, hi = metric.minimum, metric.maximum
    unit_lo, unit_hi = _UNIT_BOUNDS.get(metric.unit, (None, None))
    if unit_lo is not None:
        lo = unit_lo if lo is None else max(lo, unit_lo)
    if unit_hi is not None:
        hi = unit_hi if hi is None else min(hi, unit_hi)
    return lo, hi


def _a(noun: str) -> str:
    return f"{'an' if noun[:1] in 'aeiou' else 'a'} {noun}"


def _check_declared(catalogue: Catalogue, data: TargetData, out: list[Violation]) -> None:
    for name, declared in data.declared.items():
        metric = catalogue[name]
        want_instrument = "counter" if metric.instrument == "event" else metric.instrument
        for d in declared:
            if d.unit is not None and d.unit != metric.unit:
                shown = d.unit if d.unit else "(none)"
                out.append(
                    Violation(
                        name,
                        None,
                        "unit",
                        f"{d.found_as} declares unit {shown!r}, the catalogue says "
                        f"{metric.unit!r} ({metric.prometheus_name} in Prometheus)",
                    )
                )
            if d.instrument != want_instrument:
                out.append(
                    Violation(
                        name,
                        None,
                        "instrument",
                        f"{d.found_as} is {_a(d.instrument or 'untyped metric')}, "
                        f"the catalogue says {want_instrument}",
                    )
                )
    for u in data.unknown:
        out.append(Violation(u.name, u.rank, "name", f"not in catalogue: {u.evidence}"))
    for m in data.misnamed:
        out.append(Violation(m.name, m.rank, "name", m.evidence))
    for rank, attr in data.resource_missing:
        out.append(Violation("*", rank, "resource-attribute", f"resource lacks {attr}"))
    for rank, evidence in data.resource_invalid:
        out.append(Violation("*", rank, "resource-attribute", evidence))


class _NotStrictJSON(ValueError):
    """JSON that Python's reader takes and the JSON standard (RFC 8259) does not."""


def _refuse_constant(name: str) -> object:
    """`json.loads` reads NaN, Infinity and -Infinity by default; JSON has no such values
    (RFC 8259), and strict readers of the evidence (a browser's JSON.parse, Go's
    encoding/json) refuse the whole document."""
    raise _NotStrictJSON(f"is not strict JSON (holds {name})")


def _check_events(
    catalogue: Catalogue, data: TargetData, out: list[Violation], warnings: list[str]
) -> None:
    """Each event's kind, reason and JSON. Evidence that holds a bare NaN or Infinity is
    a warning (`--strict` fails it), not a violation: trainspec's own writer wrote such
    evidence until 2026-11-28 (`strict_json`), and a stored run of then stays compliant."""
    kinds = sorted({m.store_column for m in catalogue.in_table("events") if m.store_column})
    loose: list[str] = []
    for e in data.events:
        where = f"event {e.kind}/{e.name}"
        if e.kind not in kinds:
            out.append(Violation("events", e.rank, "event", f"{where}: kind not one of {kinds}"))
        if not (e.reason or "").strip():
            out.append(Violation("events", e.rank, "event", f"{where}: empty reason"))
        for label, text, required in (
            ("evidence", e.evidence, True),
            ("before", e.before, False),
            ("after", e.after, False),
        ):
            if text is None and not required:
                continue
            try:
                json.loads(text if text is not None else "", parse_constant=_refuse_constant)
            except _NotStrictJSON as exc:
                loose.append(f"{where}: {label} {text!r} {exc}")
            except ValueError:
                out.append(
                    Violation("events", e.rank, "event", f"{where}: {label} {text!r} is not JSON")
                )
    if loose:
        more = f" (and {len(loose) - 1} more)" if len(loose) > 1 else ""
        warnings.append(f"{loose[0]}{more}: strict readers refuse it")


def judge(data: TargetData, catalogue: Catalogue) -> Report:
    """Apply every rule to a target's statistics."""
    out: list[Violation] = []
    by_rank: dict = {}
    for s in data.series:
        by_rank.setdefault(s.rank, {}).setdefault(s.metric, []).append(s)
    for u in data.unknown:
        by_rank.setdefault(u.rank, {})
    if not data.series and not data.unknown:
        out.append(Violation("*", None, "rank-present", "the target holds no metric data"))
    else:
        _check_ranks(data, by_rank, out)
        _check_required(catalogue, data, by_rank, out)
    for s in data.series:
        _check_series(catalogue[s.metric], s, data, out)
    _check_declared(catalogue, data, out)
    warnings, notes = list(data.warnings), list(data.notes)
    _check_events(catalogue, data, out, warnings)
    # A scrape or a single export cannot show cadence: a note, which `--strict` passes (it
    # could never pass one before). A stored run whose series hold one point each is odd.
    if not data.timed and data.series:
        notes.append("cadence not judged: the points carry no timestamps (one snapshot)")
    elif data.series and all(s.p95_gap_s is None for s in data.series):
        untimed = "cadence not judged: no series holds two timed points"
        (warnings if data.kind == "run" else notes).append(untimed)
    export = data.export_interval_s
    if export is not None and any(
        m.interval_s is not None and m.interval_s < export for m in catalogue
    ):
        notes.append(
            f"cadence judged against the export interval ({_fmt(export)} s, from the points' "
            "times) where the catalogue's is shorter: an export carries one point per series"
            if data.export_gaps >= 2
            else f"cadence not judged where the catalogue's interval is shorter than the one "
            f"gap between two exports ({_fmt(export)} s): one gap cannot tell a late export "
            "from the export interval"
        )
    return Report(
        target=data.source,
        kind=data.kind,
        catalogue_version=catalogue.version,
        violations=out,
        warnings=warnings,
        notes=notes,
        ranks=sorted(data.ranks, key=lambda r: -1 if r is None else r),
        series=len(data.series),
    )


def validate_payload(target: str, catalogue: Catalogue | None = None) -> Report:
    """Read and judge a Prometheus exposition (file or URL) or an OTLP payload file.

    Raises TargetError (one line) when it cannot be read. Runs are judged by
    `trainspec.store.compliance.validate_target`, which reads them through the store.
    """
    catalogue = catalogue or load_catalogue()
    return judge(read_target(str(target), catalogue), catalogue)
