"""Read a Prometheus text exposition (or OpenMetrics) into normalized `Point`s.

Parsing is prometheus_client's (`parser.py` for the text format, `openmetrics.parser` when
the body ends in `# EOF`). Names are mapped back to the catalogue through the derivation in
`names.py`; a `trainspec_` family that matches a catalogue metric except for its unit suffix
(`trainspec_step_duration_milliseconds`) is kept under that metric with the unit it declared,
so the validator reports a wrong unit rather than an unknown name. Labels are mapped back to
dotted attribute names (`gpu_index` -> `gpu.index`). What promtool refuses and the parser
lets through is refused here too (TargetError): a carriage return, a second HELP or TYPE line
for one name, a histogram or summary count that is no whole number of at least 0. A summary
family is read as one summary point per series (count and sum), as OTLP has them.
"""

from __future__ import annotations

import http.client
import io
import math
import threading
import urllib.error
import urllib.request

from trainspec.schema.catalogue import Catalogue, Metric
from trainspec.schema.names import UNIT_SUFFIX, unit_suffix
from trainspec.schema.targets.model import TargetError
from trainspec.schema.targets.points import Point

# Prometheus type -> (OTLP-like point kind, monotonic)
_KIND = {"gauge": ("gauge", None), "counter": ("sum", True), "histogram": ("histogram", None)}
# Suffixes people write for units the catalogue does not use, read back to UCUM for the report.
_OTHER_SUFFIXES = {
    "milliseconds": "ms",
    "microseconds": "us",
    "nanoseconds": "ns",
    "kilobytes": "kBy",
    "megabytes": "MBy",
    "gigabytes": "GBy",
    "percent": "%",
    "millijoules": "mJ",
    "milliwatts": "mW",
    "megahertz": "MHz",
    "per_second": "{unit}/s",
}
_SUFFIX_UNIT = {v: k for k, v in UNIT_SUFFIX.items()} | _OTHER_SUFFIXES
FETCH_TIMEOUT_S = 10.0


# The largest exposition or payload judged: the statistics take about 20 times the body in
# memory, and a 130 MB body took a minute and 2.8 GB. A real scrape is a few MB.
MAX_BODY_BYTES = 64 << 20


def fetch(url: str, *, timeout_s: float = FETCH_TIMEOUT_S) -> bytes:
    """GET a /metrics endpoint; raises TargetError with a one-line reason.

    `timeout_s` bounds the whole exchange, not each socket read: a server that sends a byte
    every few seconds would otherwise hold `trainspec validate` forever. The request runs
    on a daemon thread, so one that overruns is abandoned, not waited for.
    """
    outcome: list[bytes | BaseException] = []

    def get() -> None:
        try:
            req = urllib.request.Request(url, headers={"Accept": "text/plain;version=0.0.4"})
            with urllib.request.urlopen(req, timeout=timeout_s) as resp:
                body = resp.read(MAX_BODY_BYTES + 1)
                if len(body) > MAX_BODY_BYTES:
                    raise ValueError(f"the body is larger than {MAX_BODY_BYTES >> 20} MiB")
                if getattr(resp, "length", None):  # a sized read stops at EOF without a word
                    raise http.client.IncompleteRead(body, resp.length)
                outcome.append(body)
        except BaseException as exc:  # handed to the caller's thread below
            outcome.append(exc)

    worker = threading.Thread(target=get, name="trainspec-validate-fetch", daemon=True)
    worker.start()
    worker.join(timeout_s)
    if not outcome:
        raise TargetError(f"{url}: cannot fetch: no complete answer in {timeout_s:g} s")
    result = outcome[0]
    if isinstance(result, bytes):
        return result
    if isinstance(result, (urllib.error.URLError, OSError, ValueError, http.client.HTTPException)):
        # One line: a bad status line, for one, carries the server's bytes and their CRLF.
        reason = " ".join(str(result).split()) or type(result).__name__
        raise TargetError(f"{url}: cannot fetch: {reason}") from result
    raise result


def _base(name: str) -> tuple[str, str | None]:
    """(name without its unit suffix and _total, the suffix) for a Prometheus family name."""
    name = name.removesuffix("_total")
    for suffix in sorted(_SUFFIX_UNIT, key=len, reverse=True):
        if name.endswith("_" + suffix):
            return name[: -len(suffix) - 1], suffix
    return name, None


class _NameMap:
    def __init__(self, catalogue: Catalogue) -> None:
        self.exact: dict[str, Metric] = {}
        self.by_base: dict[str, Metric] = {}
        self.labels: dict[str, str] = {}
        for m in catalogue:
            self.exact[m.prometheus_name] = m
            self.exact[m.prometheus_name.removesuffix("_total")] = m
            self.by_base[_base(m.prometheus_name)[0]] = m
            for attr in (*m.required_attributes, *m.optional_attributes):
                self.labels[attr.replace(".", "_")] = attr
        for attr in catalogue.resource_attributes:
            self.labels[attr.replace(".", "_")] = attr

    def resolve(self, family: str, declared_unit: str) -> tuple[str, str | None]:
        """(catalogue name or the family name, the UCUM unit the family declares)."""
        metric = self.exact.get(family)
        if metric is not None:
            suffix = unit_suffix(metric.unit, metric.instrument)
            if declared_unit and declared_unit != suffix:
                return metric.name, _SUFFIX_UNIT.get(declared_unit, f"_{declared_unit}")
            return metric.name, metric.unit
        base, family_suffix = _base(family)
        metric = self.by_base.get(base)
        if metric is None:
            return family, None
        unit = _SUFFIX_UNIT.get(family_suffix, f"_{family_suffix}") if family_suffix else ""
        return metric.name, unit


LINE_SHOWN = 80  # characters of a line the parser refused shown in its error


class _CountedLines:
    """The lines of a text, counting how many the parser has read: it reads one at a time
    and raises on the line it cannot parse, without saying which."""

    def __init__(self, text: str) -> None:
        self._lines = io.StringIO(text)
        self.number = 0
        self.line = ""

    def __iter__(self) -> _CountedLines:
        return self

    def __next__(self) -> str:
        line = self._lines.readline()
        if not line:
            raise StopIteration
        self.number, self.line = self.number + 1, line
        return line


def _shown_line(line: str) -> str:
    text = line.rstrip("\n")
    return repr(text if len(text) <= LINE_SHOWN else text[: LINE_SHOWN - 3] + "...")


def _parse_families(text: str):
    try:
        if text.rstrip().endswith("# EOF"):
            from prometheus_client.openmetrics.parser import text_fd_to_metric_families
        else:
            from prometheus_client.parser import text_fd_to_metric_families
    except ImportError as exc:
        raise TargetError(
            "reading a Prometheus exposition needs prometheus_client "
            "(pip install 'trainspec[prometheus]')"
        ) from exc
    lines = _CountedLines(text)
    try:
        return list(text_fd_to_metric_families(lines))
    except (ValueError, KeyError, IndexError, TypeError) as exc:
        reason = next((ln for ln in str(exc).splitlines() if ln.strip()), type(exc).__name__)
        where = f"line {lines.number}: {_shown_line(lines.line)}: " if lines.number else ""
        raise TargetError(f"not a Prometheus exposition: {where}{reason}") from exc


def _sample_names(text: str) -> set[str]:
    """The metric names the sample lines spell (the text parser renames a counter's samples
    to end in `_total` whatever they were written as)."""
    names = set()
    for line in text.split("\n"):
        stripped = line.strip()
        if stripped and not stripped.startswith("#"):
            names.add(stripped.split("{", 1)[0].split(None, 1)[0])
    return names


def _counter_name_fault(family, catalogue: Catalogue, name: str, written: set[str]) -> str | None:
    """Why a counter family breaks the naming rule: its samples lack the `_total` suffix
    (OpenMetrics, and the OpenTelemetry-to-Prometheus rule every catalogue name follows)."""
    if family.type != "counter" or family.name not in written or name not in catalogue.metrics:
        return None
    return (
        f"counter {family.name} lacks the _total suffix "
        f"(the catalogue names it {catalogue[name].prometheus_name})"
    )


def _malformed(sample, why: str) -> TargetError:
    return TargetError(f"not a Prometheus exposition: {sample.name} {why}")


def _bound(sample) -> float:
    """A bucket's `le` as a number; the OpenMetrics parser refuses the same bounds."""
    le = sample.labels.get("le", "+Inf")
    try:
        bound = float(le)
    except ValueError:
        bound = math.nan
    if math.isnan(bound):
        raise _malformed(sample, f'has le="{le}": a bucket bound must be a number')
    return bound


def _whole(sample, kind: str = "histogram") -> int:
    """A bucket's or count's value as an observation count: a whole number, at least 0.
    NaN, infinity, -5 or 34.7 is no count (int() read 34.7 as 34, so a `_count` that
    disagreed with its `+Inf` bucket passed, and all-negative counts passed as cumulative)."""
    value = float(sample.value)
    if not math.isfinite(value) or value < 0 or not value.is_integer():
        raise _malformed(
            sample, f"is {sample.value:g}: a {kind} count must be a whole number, at least 0"
        )
    return int(value)


def _summaries(family, labels_of, base: dict) -> list[Point]:
    """A summary family as one point per series (its labels less `quantile`): count and
    sum, as OTLP's summary point. Its `_sum` and `_count` samples read as two values of one
    untyped series, a false `duplicate`, and its instrument as "an untyped metric"."""
    series: dict[tuple, dict] = {}
    for s in family.samples:
        key_labels = {k: v for k, v in s.labels.items() if k != "quantile"}
        key = tuple(sorted(key_labels.items()))
        entry = series.setdefault(key, {"labels": key_labels, "ts": s.timestamp})
        if s.name.endswith("_sum"):
            entry["sum"] = float(s.value)
        elif s.name.endswith("_count"):
            entry["count"] = _whole(s, "summary")
    return [
        Point(
            kind="summary",
            ts=_ts(entry["ts"]),
            attributes=labels_of(entry["labels"]),
            count=entry.get("count"),
            sum=entry.get("sum"),
            **base,
        )
        for entry in series.values()
    ]


def _histograms(family, labels_of, base: dict) -> list[Point]:
    series: dict[tuple, dict] = {}
    for s in family.samples:
        key_labels = {k: v for k, v in s.labels.items() if k != "le"}
        key = tuple(sorted(key_labels.items()))
        h = series.setdefault(key, {"labels": key_labels, "buckets": [], "ts": s.timestamp})
        if s.name.endswith("_bucket"):
            h["buckets"].append((_bound(s), _whole(s)))
        elif s.name.endswith("_sum"):
            h["sum"] = float(s.value)  # NaN or infinite: the validator's `finite` rule says so
        elif s.name.endswith("_count"):
            h["count"] = _whole(s)
    points = []
    for h in series.values():
        buckets = sorted(h["buckets"])
        _check_cumulative(family.name, buckets, h.get("count"))
        points.append(
            Point(
                kind="histogram",
                ts=_ts(h["ts"]),
                attributes=labels_of(h["labels"]),
                temporality="cumulative",
                count=h.get("count"),
                sum=h.get("sum"),
                bucket_bounds=tuple(b for b, _ in buckets if b != float("inf")),
                bucket_counts=tuple(c for _, c in buckets),
                **base,
            )
        )
    return points


def _check_cumulative(name: str, buckets: list[tuple[float, int]], count: int | None) -> None:
    """A histogram's buckets count every observation at or below their bound: they never
    fall as the bound rises, the last is `+Inf`, and it equals `_count`."""
    for (lo, below), (hi, above) in zip(buckets, buckets[1:]):
        if above < below:
            raise TargetError(
                f"not a Prometheus exposition: {name}_bucket falls from {below} at le={lo:g} "
                f"to {above} at le={hi:g}: buckets are cumulative"
            )
    if buckets and buckets[-1][0] != math.inf:
        raise TargetError(f'not a Prometheus exposition: {name}_bucket has no le="+Inf"')
    if buckets and count is not None and buckets[-1][1] != count:
        raise TargetError(
            f'not a Prometheus exposition: {name}_bucket{{le="+Inf"}} is {buckets[-1][1]} '
            f"but {name}_count is {count}"
        )


def _ts(timestamp: object) -> float | None:
    return float(timestamp) if timestamp is not None else None  # type: ignore[arg-type]


def _check_timestamps(families, text: str) -> None:
    """A sample's timestamp is a number of milliseconds: the text parser reads NaN and
    +-Inf ones (promtool refuses them: "expected integer as timestamp"), and a NaN time
    dropped out of the cadence gaps, so one hid the gap it sat in."""
    for family in families:
        for s in family.samples:
            ts = _ts(s.timestamp)
            if ts is not None and not math.isfinite(ts):
                where = _line_of(text, s.name, ts)
                raise TargetError(
                    f"not a Prometheus exposition: {where}{s.name} has timestamp {ts}: "
                    "a timestamp must be a finite number of milliseconds"
                )


def _line_of(text: str, name: str, ts: float) -> str:
    """ "line N: " for the first sample line of `name` whose timestamp reads as `ts`."""
    for number, line in enumerate(text.splitlines(), 1):
        stripped = line.strip()
        if not stripped.startswith(name) or stripped.startswith("#"):
            continue
        rest = stripped[len(name) :]
        if rest[:1] not in ("{", " ", "\t"):
            continue
        tokens = rest.rsplit("}", 1)[-1].split() if rest.startswith("{") else rest.split()
        if len(tokens) >= 2:
            try:
                stamp = float(tokens[1])
            except ValueError:
                continue
            if stamp == ts or (math.isnan(stamp) and math.isnan(ts)):
                return f"line {number}: "
    return ""


def _check_line_ends(text: str) -> None:
    """A carriage return: prometheus_client's parser strips it, promtool and a Prometheus
    server refuse it (CRLF line ends: `unknown metric type "counter\\r"`)."""
    if "\r" in text:
        line = text.count("\n", 0, text.index("\r")) + 1
        raise TargetError(f"not a Prometheus exposition: carriage return on line {line}")


def _check_families_once(text: str) -> None:
    """A second HELP or TYPE line for one name (a family written twice, or two scrapes
    concatenated): prometheus_client reads them as one family, promtool refuses them
    ("second HELP line for metric name"). Checked after the samples, so a malformed
    histogram is named first."""
    seen: set[tuple[str, str]] = set()
    for number, line in enumerate(text.split("\n"), 1):
        words = line.split(None, 3)
        if len(words) < 3 or words[0] != "#" or words[1] not in ("HELP", "TYPE"):
            continue
        if (words[1], words[2]) in seen:
            raise TargetError(
                f"not a Prometheus exposition: line {number}: second {words[1]} line for "
                f"metric name {words[2]!r}"
            )
        seen.add((words[1], words[2]))


def parse_exposition(body: bytes, catalogue: Catalogue) -> list[Point]:
    """Points of a Prometheus exposition, named by the catalogue where they resolve."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise TargetError(f"not a Prometheus exposition: not UTF-8 text ({exc.reason})") from exc
    _check_line_ends(text)
    families = _parse_families(text)
    if not families:
        raise TargetError("not a Prometheus exposition: no metric families")
    _check_timestamps(families, text)
    names = _NameMap(catalogue)

    def labels_of(labels: dict[str, str]) -> dict[str, object]:
        return {names.labels.get(k, k): v for k, v in labels.items()}

    points: list[Point] = []
    written = _sample_names(text)
    for family in families:
        name, unit = names.resolve(family.name, getattr(family, "unit", "") or "")
        kind, monotonic = _KIND.get(family.type, ("unknown", None))
        misnamed = _counter_name_fault(family, catalogue, name, written)
        base = {"name": name, "unit": unit, "found_as": family.name}
        if kind == "histogram":
            points.extend(_histograms(family, labels_of, base))
            continue
        if family.type == "summary":
            points.extend(_summaries(family, labels_of, base))
            continue
        for s in family.samples:
            if family.type == "counter" and s.name.endswith("_created"):
                continue  # creation timestamps, not values
            points.append(
                Point(
                    kind=kind,
                    ts=_ts(s.timestamp),
                    value=float(s.value),
                    attributes=labels_of(s.labels),
                    monotonic=monotonic,
                    temporality="cumulative" if monotonic else None,
                    misnamed=misnamed,
                    **base,
                )
            )
    _check_families_once(text)
    return points
