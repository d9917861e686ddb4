"""The Streamlit app under streamlit's AppTest, on synthetic runs (no server, no browser)."""

from __future__ import annotations

import json
import math
import os
import sys
import time
from pathlib import Path

import pyarrow as pa
import pytest
from streamlit.testing.v1 import AppTest

import trainspec.dashboards
from tests.helpers.dashboard_runs import append_steps, make_dashboard_run, make_wide_run
from trainspec.dashboards.app import ROOT_ENV

APP = Path(trainspec.dashboards.__file__).with_name("app.py")


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    root = tmp_path_factory.mktemp("runs")
    make_dashboard_run(root / "run-old", ranks=2, seconds=10.0, seed=2)
    time.sleep(0.05)
    make_dashboard_run(root / "run-new", ranks=3, seconds=30.0)
    return root


def _app(monkeypatch, root: Path) -> AppTest:
    monkeypatch.setenv(ROOT_ENV, str(root))
    return AppTest.from_file(str(APP), default_timeout=60).run()


def _text(at: AppTest) -> str:
    parts = [e.value for kind in ("subheader", "warning", "info", "error", "success", "caption")
             for e in getattr(at, kind)]  # fmt: skip
    return "\n".join(str(p) for p in parts)


def _show(at: AppTest, view: str) -> AppTest:
    return at.sidebar.radio(key="view").set_value(view).run()


def test_overview_of_the_newest_run(monkeypatch, root):
    at = _app(monkeypatch, root)
    assert not at.exception
    assert at.sidebar.selectbox(key="run").value == "run-new"
    text = _text(at)
    assert "Overview" in text
    assert "Straggler: rank 2" in text
    assert {m.label for m in at.metric} >= {"ranks", "steps", "samples rows"}
    assert at.metric[0].value == "3 / 3"


def test_overview_of_many_ranks_with_nan_values(monkeypatch, tmp_path):
    """40 ranks: the heatmap groups them (rows `0-1` ...) within 600 px; a NaN step is
    left out of the charts and counted in a caption."""
    run = make_wide_run(tmp_path / "wide", ranks=40, seconds=2.0, samples=False)
    append_steps(run, ranks=40, first_step=8, count=1, values={"duration_s": math.nan})
    at = _app(monkeypatch, tmp_path)
    assert not at.exception
    assert "40 NaN or infinite values left out of every chart." in _text(at)
    spec = json.loads(at.get("vega_lite_chart")[0].proto.spec)
    assert spec["height"] <= 600 and spec["encoding"]["y"]["sort"][:2] == ["0-1", "2-3"]


def _chart_rows(at: AppTest) -> list[int]:
    """Rows each chart sends to the browser (its datasets arrive as Arrow streams)."""
    return [
        sum(pa.ipc.open_stream(d.data.data).read_all().num_rows for d in chart.proto.datasets)
        for chart in at.get("vega_lite_chart")
    ]


def test_overview_of_1024_ranks(monkeypatch, tmp_path):
    """A line per rank sent 20,480 rows and a 1,024-entry legend for step time alone, and
    the ranks were listed in rank order: the spread, the slowest ranks, a 20-row table."""
    make_wide_run(tmp_path / "wide", ranks=1024, seconds=5.0, straggler=700)
    at = _app(monkeypatch, tmp_path)
    assert not at.exception
    text = _text(at)
    assert "Straggler: rank 700" in text and "1,004 faster ranks not listed." in text
    assert len(at.get("vega_lite_chart")) == 8  # heatmap, step time, phases, 3 series, 2 grads
    assert max(_chart_rows(at)) <= 1000  # a line per rank: 20,480 (steps), 102,400 (series)
    step_time = json.loads(at.get("vega_lite_chart")[1].proto.spec)
    assert "rank 700" in step_time["layer"][-1]["encoding"]["color"]["scale"]["domain"]
    (table,) = at.dataframe
    assert len(table.value) == 20 and int(table.value["rank"].iloc[0]) == 700


def test_a_slow_node_is_five_warnings_and_a_count(monkeypatch, tmp_path):
    """Eight slow ranks of 64 (one node): a warning box each filled the page."""
    make_wide_run(tmp_path / "node", ranks=64, seconds=2.0, straggler=range(8, 16), samples=False)
    at = _app(monkeypatch, tmp_path)
    assert not at.exception
    slowest = list(at.dataframe[0].value["rank"])  # the stragglers table, slowest first
    assert set(slowest[:8]) == set(range(8, 16))
    warned = [w.value.split(" computes")[0] for w in at.warning[:5]]
    assert warned == [f"Straggler: rank {r}" for r in slowest[:5]]
    assert len(at.warning) == 6
    assert at.warning[5].value.startswith("3 more ranks compute at least 1.2x the median rank")


def test_every_view_renders(monkeypatch, root):
    at = _app(monkeypatch, root)
    expected = {
        "Actions": "Actions and anomalies",
        "Compliance": "violations of catalogue",
        "Compare": "Compare runs",
        "Hardware": "no GPUs in this run",
    }
    for view, text in expected.items():
        at = _show(at, view)
        assert not at.exception, view
        assert text in _text(at), view
    at = _show(at, "Actions")
    assert len(at.expander) == 5  # one per decision, not one per rank


def test_compliance_says_when_the_validator_is_missing(monkeypatch, root, tmp_path):
    run = make_dashboard_run(tmp_path / "runs" / "fresh", ranks=2, seconds=4.0)
    monkeypatch.setitem(sys.modules, "trainspec.store.compliance", None)  # import fails
    at = _show(_app(monkeypatch, run.parent), "Compliance")
    assert not at.exception
    assert "validator not installed" in _text(at)


def test_compliance_of_1024_ranks_is_a_row_per_metric_and_rule(monkeypatch, tmp_path):
    """A table of 8,192 rows, one per rank for each of 8 absent metrics; now 8 rows."""
    make_wide_run(tmp_path / "wide", ranks=1024, seconds=2.0, samples=False)
    at = _show(_app(monkeypatch, tmp_path), "Compliance")
    assert not at.exception
    assert "8192 violations of catalogue" in _text(at) and " in 8 groups" in _text(at)
    (table,) = at.dataframe
    assert len(table.value) == 8
    assert set(table.value["ranks"]) == {"1,024 ranks (0-1023)"}


def test_gpu_run_has_a_hardware_view(monkeypatch, tmp_path):
    make_dashboard_run(tmp_path / "gpu", ranks=2, seconds=5.0, gpus=True)
    at = _show(_app(monkeypatch, tmp_path), "Hardware")
    assert not at.exception
    assert "no GPUs" not in _text(at)
    assert len(at.dataframe) == 1  # the GPU table


def test_missing_root_and_empty_root(monkeypatch, tmp_path):
    at = _app(monkeypatch, tmp_path / "missing")
    assert "no such runs directory" in at.error[0].value
    at = _app(monkeypatch, tmp_path)
    assert "No runs under" in at.info[0].value


def test_a_corrupt_segment_is_named_above_figures_drawn_from_the_rest(monkeypatch, tmp_path):
    """Since 2026-11-25 the damaged segment is found while the view reads, left out and
    named in a warning above the figures (filled in after they drew); it was one error line
    in place of the whole view before."""
    run = make_dashboard_run(tmp_path / "runs" / "bad", ranks=2, seconds=4.0)
    segment = sorted((run / "segments" / "steps").rglob("*.parquet"))[0]
    data = bytearray(segment.read_bytes())
    end = len(data) - int.from_bytes(data[-8:-4], "little") - 8  # keep the footer: it lists
    data[8:end] = b"\xab" * (end - 8)  # but its pages no longer read
    segment.write_bytes(bytes(data))
    at = _app(monkeypatch, run.parent)
    assert not at.exception and not at.error
    warned = [w.value for w in at.warning if "could not be read" in w.value]
    assert len(warned) == 1 and segment.name in warned[0]
    assert at.subheader  # the view drew


def _age(run: Path, seconds: float) -> None:
    """Make every file of `run` `seconds` old: a finished run, no longer live."""
    past = time.time() - seconds
    for path in run.rglob("*"):
        os.utime(path, (past, past))


def test_picking_a_live_run_turns_live_refresh_on(monkeypatch, tmp_path):
    """The toggle kept one key for every run: picked after a finished run, a live run
    stayed with refresh off (and a finished run picked after a live one, on)."""
    done = make_dashboard_run(tmp_path / "done", ranks=2, seconds=2.0)
    _age(done, 3600)
    make_dashboard_run(tmp_path / "live", ranks=2, seconds=2.0)
    at = _app(monkeypatch, tmp_path)
    assert at.sidebar.selectbox(key="run").value == "live"
    assert at.sidebar.toggle[0].value is True
    at = at.sidebar.selectbox(key="run").select_index(1).run()
    assert at.sidebar.selectbox(key="run").value == "done"
    assert at.sidebar.toggle[0].value is False
    at = at.sidebar.toggle[0].set_value(True).run()  # the user's choice for this run holds
    assert at.sidebar.toggle[0].value is True
    at = at.sidebar.selectbox(key="run").select_index(0).run()
    assert not at.exception
    assert at.sidebar.selectbox(key="run").value == "live"
    assert at.sidebar.toggle[0].value is True


def _scramble_pages(path: Path) -> None:
    """Overwrite the data pages but keep the footer: the file lists, the rows do not read."""
    data = bytearray(path.read_bytes())
    end = len(data) - int.from_bytes(data[-8:-4], "little") - 8
    data[8:end] = b"\xab" * (end - 8)
    path.write_bytes(bytes(data))


def test_compare_names_run_bs_unreadable_segments(monkeypatch, tmp_path):
    """Only A's damaged segments were named: B's figures silently lacked rows."""
    b = make_dashboard_run(tmp_path / "run-b", ranks=2, seconds=4.0)
    segment = sorted((b / "segments" / "steps").rglob("*.parquet"))[0]
    _scramble_pages(segment)
    _age(b, 60)  # older than A: A is picked, B is the one compared with
    make_dashboard_run(tmp_path / "run-a", ranks=2, seconds=4.0)
    at = _show(_app(monkeypatch, tmp_path), "Compare")
    assert not at.exception and not at.error
    assert at.sidebar.selectbox(key="run").value == "run-a"
    warned = [w.value for w in at.warning if "could not be read" in w.value]
    assert len(warned) == 1
    assert "of B (run-b)" in warned[0] and segment.name in warned[0]
    assert "unless" not in warned[0]  # no run.duckdb beside: the rows are surely missing


def test_an_anomaly_shows_plain_ranks_and_no_before_or_after(monkeypatch, root):
    """`ranks [np.int32(0), ...]`, and an anomaly (no change made) showed "Before nan" and
    "After nan": pandas reads a NULL text as NaN, which is truthy."""
    at = _show(_app(monkeypatch, root), "Actions")
    assert not at.exception
    spike = next(e for e in at.expander if "loss_spike" in e.label)
    texts = [m.value for m in spike.markdown]
    assert texts[0].startswith("ranks [0, 1, 2], ")
    assert "**Before**" not in texts and "nan" not in [c.value for c in spike.code]
    rebalance = next(e for e in at.expander if "rebalance" in e.label)
    assert {"**Before**", "**After**"} <= {m.value for m in rebalance.markdown}


def test_a_damaged_segment_a_compaction_holds_is_not_called_missing(monkeypatch, tmp_path):
    """run.duckdb beside the segments supplies the rows no readable segment holds: "their
    rows are missing from every figure" was false. Said as the CLI says it."""
    from trainspec.store import compact

    run = make_dashboard_run(tmp_path / "runs" / "bad", ranks=2, seconds=4.0)
    compact(run)
    segment = sorted((run / "segments" / "steps").rglob("*.parquet"))[0]
    _scramble_pages(segment)
    at = _app(monkeypatch, run.parent)
    assert not at.exception and not at.error
    (warned,) = [w.value for w in at.warning if "could not be read" in w.value]
    assert segment.name in warned
    assert "their rows are missing from every figure unless run.duckdb holds them" in warned
    assert at.metric[1].value == "16"  # every step: read from run.duckdb


def test_a_picked_run_stays_picked_when_it_finishes_and_another_appears(monkeypatch, tmp_path):
    """The picker's text said "(live)": once the run finished, the remembered text matched
    no option, and the rerun a new run causes jumped to the newest run (review)."""
    old = make_dashboard_run(tmp_path / "old", ranks=2, seconds=2.0)
    _age(old, 7200)
    mine = make_dashboard_run(tmp_path / "mine", ranks=2, seconds=2.0)
    at = _app(monkeypatch, tmp_path)
    assert at.sidebar.selectbox(key="run").value == "mine"
    assert any("still being written" in c.value for c in at.sidebar.caption)
    _age(mine, 3600)  # it finished
    make_dashboard_run(tmp_path / "newer", ranks=2, seconds=2.0)
    at = at.run()
    assert not at.exception
    assert at.sidebar.selectbox(key="run").value == "mine"


def test_the_page_goes_stale_when_the_picked_run_finishes_or_is_written_again(tmp_path):
    """The page's watcher (`watch_runs`) reran it only when runs appeared or went: a picked
    run that finished stayed "still being written" with refresh on until a reload (QA)."""
    from trainspec.dashboards.runs import list_run_names, page_is_stale, run_entry

    run = make_dashboard_run(tmp_path / "run", ranks=2, seconds=2.0)
    names = list_run_names(tmp_path)
    live = run_entry(run)
    assert live.live and not page_is_stale(tmp_path, names, live)
    _age(run, 3600)  # it finished
    assert page_is_stale(tmp_path, names, live)
    finished = run_entry(run)
    assert not page_is_stale(tmp_path, names, finished)
    assert not page_is_stale(tmp_path, names, None)
    os.utime(next((run / "segments").rglob("seg-*")))  # a job restarted into it writes again
    assert page_is_stale(tmp_path, names, finished)
    make_dashboard_run(tmp_path / "other", ranks=2, seconds=2.0)
    assert page_is_stale(tmp_path, names, None)


def test_a_run_that_finishes_is_no_longer_said_live_nor_refreshed(monkeypatch, tmp_path):
    """Once the picked run finished, the sidebar still said "still being written" and the
    live toggle stayed on, refreshing every 2 s until the page was reloaded (QA)."""
    run = make_dashboard_run(tmp_path / "run", ranks=2, seconds=2.0)
    at = _app(monkeypatch, tmp_path)
    assert at.sidebar.toggle[0].value is True
    assert any("still being written" in c.value for c in at.sidebar.caption)
    _age(run, 3600)  # it finished: the page's watcher reruns it (`watch_runs`)
    at = at.run()
    assert not at.exception
    assert not any("still being written" in c.value for c in at.sidebar.caption)
    assert at.sidebar.toggle[0].value is False


def test_an_action_a_restart_rolled_back_says_so_in_the_actions_view(monkeypatch, tmp_path):
    """The report marked such actions; the live view showed them as if in effect."""
    from tests.unit.test_dashboard_data import restarted

    run = make_dashboard_run(tmp_path / "resumed", ranks=2, seconds=20.0)  # actions at 40, 64
    restarted(run, 2, loaded_step=50)
    at = _show(_app(monkeypatch, tmp_path), "Actions")
    assert not at.exception
    rolled = [e.label for e in at.expander if "rolled back" in e.label]
    assert len(rolled) == 1 and rolled[0].startswith("step 64 · action · compression")
    assert rolled[0].endswith("rolled back (a restart resumed from step 50)")
