"""Violations grouped by metric and rule across ranks: the rank ranges, the representative,
and the text people read (`trainspec validate`), while the JSON keeps every violation."""

from __future__ import annotations

import json

import pytest

from tests.helpers.dashboard_runs import make_wide_run
from trainspec.cli.main import main
from trainspec.schema.catalogue import load_catalogue
from trainspec.schema.groups import format_ranks, group_violations
from trainspec.schema.targets.model import RankInfo, SeriesStats, TargetData
from trainspec.schema.validate import judge
from trainspec.schema.verdict import Report, Violation

POWER = "trainspec.gpu.power"
ABSENT = "required (gpu) but absent"


@pytest.mark.parametrize(
    ("ranks", "text"),
    [
        ([], ""),
        ([7], "7"),
        ([0, 1, 2, 3], "0-3"),
        ([0, 1], "0-1"),
        ([*range(512), 700, *range(900, 904)], "0-511, 700, 900-903"),
        ([903, 5, 901, 4, 902, 700, 3], "3-5, 700, 901-903"),  # unsorted
        ([2, 2, 1, 1, 3, 9, 9], "1-3, 9"),  # duplicates count once
    ],
)
def test_format_ranks(ranks, text):
    assert format_ranks(ranks) == text


def test_format_ranks_counts_the_ranks_past_its_limit():
    every_other = range(0, 1024, 2)
    assert format_ranks(every_other, limit=3) == "0, 2, 4, … +509 more"
    assert format_ranks(range(8), limit=1) == "0-7"  # one range: nothing left out


def _report(violations: list[Violation], ranks: int = 1024) -> Report:
    return Report("run-x", "run", "0.2", violations=violations, ranks=list(range(ranks)))


def _absent_everywhere(ranks: int) -> list[Violation]:
    return [Violation(POWER, r, "required", ABSENT) for r in range(ranks)]


def test_one_violation_on_1024_ranks_is_one_line_with_its_ranks_and_count():
    report = _report(_absent_everywhere(1024))
    head, *lines = report.render_text().splitlines()
    assert head.endswith("1024 violations in 1 group")
    assert "ranks 0-1023" in head  # not 1,024 ranks listed one by one
    assert lines == [f"  {POWER}  1,024 ranks (0-1023)  [required]  {ABSENT}"]


def test_by_rank_prints_a_line_per_violation_as_before():
    report = _report(_absent_everywhere(1024))
    head, *lines = report.render_text(by_rank=True).splitlines()
    assert head.endswith(": 1024 violations")
    assert len(lines) == 1024
    assert lines[17] == f"  {POWER}  rank 17  [required]  {ABSENT}"


def test_mixed_ranks_are_ranges_and_each_rule_its_own_line():
    ranks = [*range(512), 700, 900, 901, 902, 903]
    violations = [Violation(POWER, r, "required", ABSENT) for r in reversed(ranks)]
    violations += [Violation("*", None, "rank-present", "99 more ranks sent no data at all")]
    violations += [Violation(POWER, 3, "attribute", "missing gpu.index on series {}")]
    lines = _report(violations).render_text().splitlines()[1:]
    assert lines == [
        f"  {POWER}  517 ranks (0-511, 700, 900-903)  [required]  {ABSENT}",
        "  *  rank -  [rank-present]  99 more ranks sent no data at all",  # run-level: as is
        f"  {POWER}  rank 3  [attribute]  missing gpu.index on series {{}}",  # one rank: as is
    ]


def test_violations_each_on_one_rank_print_exactly_as_before():
    """Several violations of one rule on one rank (one per series) are not a group."""
    violations = [
        Violation(POWER, 0, "range", 'minimum -1 < 0 on {"gpu.index": 0}'),
        Violation(POWER, 0, "cadence", "p95 gap 0.9 s (max 2 s) over 9 points > 0.375 s"),
        Violation(POWER, 0, "range", 'minimum -2 < 0 on {"gpu.index": 1}'),
        Violation("*", None, "rank-present", "the target holds no metric data"),
    ]
    report = _report(violations, ranks=1)
    assert report.render_text() == report.render_text(by_rank=True)
    assert report.render_text().splitlines() == [
        "run-x (run, catalogue 0.2, ranks 0, 0 series): 4 violations",
        f'  {POWER}  rank 0  [range]  minimum -1 < 0 on {{"gpu.index": 0}}',
        f"  {POWER}  rank 0  [cadence]  p95 gap 0.9 s (max 2 s) over 9 points > 0.375 s",
        f'  {POWER}  rank 0  [range]  minimum -2 < 0 on {{"gpu.index": 1}}',
        "  *  rank -  [rank-present]  the target holds no metric data",
    ]


def test_every_violation_is_in_exactly_one_group():
    violations = [Violation(POWER, r % 5, "range", f"maximum {r} > 1") for r in range(20)]
    violations += [Violation(POWER, None, "unit", "declares W")] * 2
    groups = group_violations(violations)
    grouped = [v for g in groups for v in g.violations]
    assert sorted(grouped, key=repr) == sorted(violations, key=repr)
    assert [len(g.violations) for g in groups] == [20, 1, 1]
    assert groups[0].ranks_text == "5 ranks (0-4), 20 violations"


def _judged(gaps: dict[int, float], maxima: dict[int, float]) -> Report:
    """The validator's own evidence: memory pressure sampled every `gaps[rank]` seconds,
    reaching `maxima[rank]` (a ratio, so over 1 is out of range)."""
    data = TargetData(source="x", kind="prometheus", world_size=len(gaps))
    for rank, gap in gaps.items():
        data.ranks[rank] = RankInfo(gpu=False, cuda=False)
        data.series.append(
            SeriesStats("trainspec.memory.pressure", rank, {}, count=40, p95_gap_s=gap,
                        max_gap_s=gap, minimum=0.1, maximum=maxima[rank])
        )  # fmt: skip
    return judge(data, load_catalogue())


def test_the_representative_is_the_worst_rank_where_the_evidence_measures_it():
    gaps = {r: 0.2 + r / 1000 for r in range(64)} | {17: 0.52}
    maxima = {r: 1.0 + r / 1000 for r in range(64)} | {40: 1.9}
    lines = _judged(gaps, maxima).render_text().splitlines()
    (cadence,) = [line for line in lines if "[cadence]" in line]
    assert cadence.startswith("  trainspec.memory.pressure  64 ranks (0-63)  [cadence]  ")
    assert "p95 gap 0.52 s" in cadence and cadence.endswith("(worst: rank 17)")
    (over,) = [line for line in lines if "[range]" in line]
    assert "63 ranks (1-63)" in over  # rank 0 reaches 1.0 exactly: in range
    assert "maximum 1.9 > 1" in over and over.endswith("(worst: rank 40)")


def test_the_lowest_rank_speaks_for_a_rule_without_a_measure():
    violations = [Violation("events", r, "event", f"event x/{r}: empty reason") for r in (9, 4)]
    (line,) = _report(violations).render_text().splitlines()[1:]
    assert line.endswith("event x/4: empty reason  (as on rank 4; others differ)")


def test_json_lists_every_violation_unchanged():
    violations = _absent_everywhere(1024) + [Violation("*", None, "rank-present", "none")]
    doc = json.loads(_report(violations).render_json())
    assert list(doc) == [
        "target", "kind", "catalogue_version", "compliant", "strict", "passed", "ranks",
        "series", "violations", "warnings", "notes",
    ]  # fmt: skip
    assert doc["violations"] == [v.to_dict() for v in violations]
    assert doc["violations"][1023] == {
        "metric": POWER, "rank": 1023, "rule": "required", "evidence": ABSENT
    }  # fmt: skip


@pytest.fixture(scope="module")
def wide_run(tmp_path_factory):
    """1,024 ranks of steps only: 8 sampled metrics absent on every rank, 8,192 violations."""
    return make_wide_run(tmp_path_factory.mktemp("runs") / "wide", ranks=1024, seconds=2.0,
                         samples=False)  # fmt: skip


def test_validate_prints_a_line_per_metric_and_rule_for_a_wide_run(wide_run, capsys):
    assert main(["validate", str(wide_run)]) == 1
    head, warning, *lines = capsys.readouterr().out.splitlines()
    assert head.endswith("ranks 0-1023, 16384 series): 8192 violations in 8 groups")
    assert warning.startswith("  warning: cadence not judged")  # no samples at all
    assert len(lines) == 8
    assert all("  1,024 ranks (0-1023)  [required]  required (" in line for line in lines)


def test_validate_by_rank_and_json_list_every_violation(wide_run, capsys):
    assert main(["validate", str(wide_run), "--by-rank"]) == 1
    head, _warning, *lines = capsys.readouterr().out.splitlines()
    assert head.endswith(": 8192 violations") and len(lines) == 8192
    assert main(["validate", str(wide_run), "--json"]) == 1
    doc = json.loads(capsys.readouterr().out)
    assert len(doc["violations"]) == 8192 and doc["compliant"] is False


@pytest.mark.parametrize(
    ("ranks", "shown"),
    [([], "none"), ([None], "?"), ([None, 0, 1, 2, 5], "?, 0-2, 5"), ([3], "3")],
)
def test_the_verdict_line_writes_the_runs_ranks_as_ranges(ranks, shown):
    report = Report("t", "prometheus", "0.2", ranks=ranks)
    assert (
        report.render_text() == f"t (prometheus, catalogue 0.2, ranks {shown}, 0 series): COMPLIANT"
    )


def test_one_violation_is_said_in_the_singular():
    report = _report([Violation(POWER, 0, "range", "maximum 2 > 1")], ranks=1)
    assert report.render_text().splitlines()[0].endswith("): 1 violation")
