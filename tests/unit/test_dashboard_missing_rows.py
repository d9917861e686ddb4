"""A run with samples but no `runs` or `steps` rows (an agent that stored a rank's readings
and never its runs row; QA roots/r_nan/poisonrun): the headline said "ranks 0 / 0"."""

from __future__ import annotations

from pathlib import Path

import pytest
from streamlit.testing.v1 import AppTest

import trainspec.dashboards
import trainspec.store as store
from tests.helpers.dashboard_runs import append_samples, make_dashboard_run
from trainspec.dashboards.app import ROOT_ENV
from trainspec.dashboards.runs import load_summary

APP = Path(trainspec.dashboards.__file__).with_name("app.py")


def _samples_only_run(run: Path) -> Path:
    for rank in (0, 2):
        append_samples(run, rank=rank, metric="trainspec.memory.pressure",
                       values=[0.4, 0.5, 0.6], at_s=1.0)  # fmt: skip
    return run


def test_the_ranks_with_samples_count_and_the_world_size_is_unknown(tmp_path):
    summary = load_summary(store.open(_samples_only_run(tmp_path / "samples-only")))
    assert summary.ranks == [0, 2] and summary.sample_rows == 6 and summary.steps == 0
    assert summary.world_size == 0 and summary.ranks_text == "2 / ?"
    note = summary.missing_rows_note()
    assert "no runs or steps rows" in note and "world size is unknown" in note


def test_a_run_with_runs_rows_keeps_its_world_size(tmp_path):
    summary = load_summary(store.open(make_dashboard_run(tmp_path / "whole", ranks=2, seconds=1.0)))
    assert summary.ranks == [0, 1] and summary.ranks_text == "2 / 2"
    assert summary.missing_rows_note() == ""


@pytest.mark.timeout(120)
def test_the_overview_headline_shows_the_ranks_with_samples(monkeypatch, tmp_path):
    _samples_only_run(tmp_path / "samples-only")
    monkeypatch.setenv(ROOT_ENV, str(tmp_path))
    at = AppTest.from_file(str(APP), default_timeout=60).run()
    assert not at.exception
    (ranks,) = [m for m in at.metric if m.label == "ranks"]
    assert ranks.value == "2 / ?"
    assert any("no runs or steps rows" in c.value for c in at.caption), [
        c.value for c in at.caption
    ]


def test_the_report_says_the_world_size_is_unknown(tmp_path):
    from trainspec.dashboards.report import render_report

    run = _samples_only_run(tmp_path / "samples-only")
    (out,) = render_report(run, html=tmp_path / "r.html")
    assert "<td>2 of world size unknown (no runs rows)</td>" in out.read_text()


def test_runs_rows_without_a_world_size_are_not_called_missing():
    """The note said "no runs rows" where runs rows were there with no world size."""
    from trainspec.dashboards.runs import RunSummary

    summary = RunSummary(run_id="r", world_size=0, ranks=[0], hosts=[], device="cpu",
                         steps=3, runs_rows=1)  # fmt: skip
    note = summary.missing_rows_note()
    assert "no runs rows" not in note and "name no world size" in note, note
