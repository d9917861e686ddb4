"""`trainspec report`: headline plots as PNG files or one HTML file, and its error paths."""

from __future__ import annotations

import base64
import contextlib
import math
import re
import warnings
from html.parser import HTMLParser
from pathlib import Path

import matplotlib.image as mpimg
import pytest

from tests.helpers.cli import one_line_error
from tests.helpers.dashboard_runs import (
    append_samples,
    append_steps,
    make_dashboard_run,
    make_wide_run,
)
from trainspec.cli.main import main

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    return make_dashboard_run(tmp_path_factory.mktemp("runs") / "run-a", ranks=3, seconds=20.0)


def test_png_dir_holds_the_headline_plots(run_dir, tmp_path, capsys):
    assert main(["report", str(run_dir), "--png", str(tmp_path / "plots")]) == 0
    names = sorted(p.stem for p in (tmp_path / "plots").glob("*.png"))
    assert names == ["events", "gradients", "heatmap", "phases", "series", "step_time"]
    image = mpimg.imread(tmp_path / "plots" / "heatmap.png")  # read back as a real PNG
    assert image.shape[0] > 200 and image.shape[1] > 600
    assert image[..., :3].std() > 0.05  # drawn, not blank
    assert len(capsys.readouterr().out.splitlines()) == 6


def test_html_is_self_contained(run_dir, tmp_path):
    out = tmp_path / "r" / "report.html"
    assert main(["report", str(run_dir), "--html", str(out)]) == 0
    text = out.read_text()
    images = re.findall(r"src='data:image/png;base64,([^']+)'", text)
    assert len(images) == 6
    assert all(base64.b64decode(b)[:8] == PNG_MAGIC for b in images)
    assert "rebalance" in text and "Stragglers" in text
    assert "violation" in text  # the compliance verdict is in the report
    assert "http://" not in text and "https://" not in text  # nothing fetched when opened


def test_compacted_run_reports_too(run_dir, tmp_path):
    from trainspec.store import compact

    target = compact(run_dir)
    assert main(["report", str(target), "--png", str(tmp_path)]) == 0
    assert (tmp_path / "heatmap.png").read_bytes()[:8] == PNG_MAGIC


@pytest.mark.parametrize("bad", ["missing-dir", "empty-run", "not-a-run.txt"])
def test_bad_run_is_one_line_and_exit_2(bad, tmp_path, capsys):
    target = tmp_path / bad
    if bad == "empty-run":
        (target / "segments").mkdir(parents=True)
    elif bad.endswith(".txt"):
        target.write_text("hello")
    assert main(["report", str(target), "--png", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("trainspec report: error:")
    assert not (tmp_path / "out").exists()


def _scramble_pages(path) -> None:
    """Overwrite the data pages but keep the footer: the file lists, the rows do not read."""
    data = bytearray(path.read_bytes())
    footer = int.from_bytes(data[-8:-4], "little") + 8  # the footer, its length and b"PAR1"
    end = len(data) - footer
    data[8:end] = b"\xab" * (end - 8)
    path.write_bytes(bytes(data))


def test_a_segment_damaged_behind_its_footer_is_named_and_left_out(tmp_path, capsys):
    """Since 2026-11-25 the damaged segment is skipped, named, and the report drawn from the
    rest; it failed the whole report before."""
    run = make_dashboard_run(tmp_path / "run", ranks=2, seconds=4.0)
    bad = sorted((run / "segments" / "steps").rglob("*.parquet"))[0]
    _scramble_pages(bad)
    assert main(["report", str(run), "--html", str(tmp_path / "r.html")]) == 0
    err = capsys.readouterr().err
    assert str(bad) in err and "Traceback" not in err
    assert (tmp_path / "r.html").exists()


def test_a_damaged_compacted_file_alone_is_one_line_and_exit_2(tmp_path, capsys):
    from trainspec.store import compact

    run = make_dashboard_run(tmp_path / "run", ranks=2, seconds=4.0)
    compacted = compact(run)
    target = tmp_path / "only-compacted"
    target.mkdir()
    data = compacted.read_bytes()
    (target / compacted.name).write_bytes(data[: len(data) * 2 // 5])
    assert main(["report", str(target), "--html", str(tmp_path / "r.html")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"trainspec report: error: {target}: cannot read")
    assert not (tmp_path / "r.html").exists()


@pytest.mark.parametrize("where", ["run.duckdb", "segments/steps/x.html", "segments"])
def test_a_report_is_never_written_into_the_runs_stored_data(tmp_path, capsys, where):
    """`--html RUN/run.duckdb` replaced the compacted file with HTML; a path under
    `segments/` destroyed a segment."""
    import shutil

    from trainspec.store import compact

    run = tmp_path / "run"
    shutil.copytree(make_dashboard_run(tmp_path / "src", ranks=1, seconds=5.0), run)
    compact(run)
    before = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
    flag = "--png" if where == "segments" else "--html"
    assert main(["report", str(run), flag, str(run / where)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "inside the run's stored data" in err
    assert {p: p.read_bytes() for p in run.rglob("*") if p.is_file()} == before


def test_the_report_says_which_segments_it_could_not_read(tmp_path):
    import shutil

    run = tmp_path / "run"
    shutil.copytree(make_dashboard_run(tmp_path / "src", ranks=2, seconds=5.0), run)
    victim = sorted((run / "segments" / "steps").rglob("seg-*.parquet"))[0]
    victim.write_bytes(victim.read_bytes()[: len(victim.read_bytes()) // 2])
    out = tmp_path / "r.html"
    assert main(["report", str(run), "--html", str(out)]) == 0
    text = out.read_text()
    assert "could not be read; their rows are missing" in text and victim.name in text


def _nan_run(path):
    run = make_dashboard_run(path, ranks=2, seconds=5.0)
    bad = {"duration_s": math.nan, "forward_s": math.inf, "loss": math.nan,
           "grad_variance": math.inf, "optimizer_s": -math.inf}  # fmt: skip
    append_steps(run, ranks=2, first_step=20, count=3, values=bad)
    append_samples(run, rank=1, metric="trainspec.memory.pressure", values=[math.nan] * 3,
                   at_s=2.0)  # fmt: skip
    return run


RUNS = {
    "nan-and-inf": _nan_run,  # inf phase bars: "invalid value encountered in scalar add"
    "one-step": lambda p: make_dashboard_run(p, ranks=2, seconds=0.25),
    "one-rank": lambda p: make_dashboard_run(p, ranks=1, seconds=2.0),
    # 40 legend entries: "constrained_layout not applied because axes sizes collapsed"
    "forty-ranks": lambda p: make_wide_run(p, ranks=40, seconds=2.0),
}


@pytest.mark.parametrize("shape", sorted(RUNS))
def test_the_report_draws_without_a_warning(shape, tmp_path, capsys):
    """Matplotlib's warnings about NaN bars and overfull legends reached the terminal."""
    run = RUNS[shape](tmp_path / shape)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert main(["report", str(run), "--html", str(tmp_path / "r.html")]) == 0
    assert [f"{w.category.__name__}: {w.message}" for w in caught] == []
    assert capsys.readouterr().err == ""


class _Sections(HTMLParser):
    """The report read back by the standard library's HTML parser: each `<h2>` heading's
    table rows, as lists of cell texts."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: dict[str, list[list[str]]] = {}
        self._heading = ""
        self._tag = ""

    def handle_starttag(self, tag, attrs):
        self._tag = tag
        if tag == "h2":
            self._heading = ""
        elif tag == "tr":
            self.rows.setdefault(self._heading, []).append([])
        elif tag in ("td", "th"):
            self.rows[self._heading][-1].append("")

    def handle_data(self, data):
        if self._tag == "h2":
            self._heading += data
        elif self._tag in ("td", "th"):
            self.rows[self._heading][-1][-1] += data

    def handle_endtag(self, tag):
        self._tag = ""


def test_the_compliance_section_of_1024_ranks_is_a_row_per_metric_and_rule(tmp_path):
    """Eight metrics absent on 1,024 ranks were 8,192 rows; now 8, each naming its ranks."""
    run = make_wide_run(tmp_path / "wide", ranks=1024, seconds=2.0, samples=False)
    assert main(["report", str(run), "--html", str(tmp_path / "r.html")]) == 0
    text = (tmp_path / "r.html").read_text()
    sections = _Sections()
    sections.feed(text)
    header, *rows = sections.rows["Compliance"]
    assert header == ["metric", "ranks", "rule", "evidence", "violations"]
    assert len(rows) == 8
    assert {(r[1], r[2], r[4]) for r in rows} == {("1,024 ranks (0-1023)", "required", "1024")}
    assert re.search(r"8192 violations of catalogue [\d.]+ in 8 groups", text)
    assert "trainspec validate --by-rank" in text


@pytest.mark.parametrize("flag", ["--png", "--html"])
def test_an_empty_output_path_is_refused(run_dir, tmp_path, capsys, monkeypatch, flag):
    """`--png ""` wrote the plots into the current directory."""
    monkeypatch.chdir(tmp_path)
    one_line_error(capsys, main(["report", str(run_dir), flag, ""]), flag, "empty")
    assert not list(tmp_path.glob("*.png"))


def test_an_anomaly_row_has_empty_before_and_after_cells(run_dir, tmp_path):
    """An anomaly changes nothing: its before and after cells read `NaN`."""
    assert main(["report", str(run_dir), "--html", str(tmp_path / "r.html")]) == 0
    sections = _Sections()
    sections.feed((tmp_path / "r.html").read_text())
    header, *rows = sections.rows["Anomalies and actions"]
    cells = [dict(zip(header, row)) for row in rows]
    spike = next(c for c in cells if c["name"] == "loss_spike")
    assert (spike["before"], spike["after"]) == ("", "")
    rebalance = next(c for c in cells if c["name"] == "rebalance")
    assert '"shares"' in rebalance["before"] and '"shares"' in rebalance["after"]
    assert not any(v == "NaN" for c in cells for v in c.values())


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs a /proc file system")
def test_an_output_that_cannot_be_created_is_named_not_the_temporary_file(run_dir, capsys):
    """`--html /proc/x.html` named the hidden temporary file (`/proc/.x.html.<pid>...tmp`):
    creating it failed outside the handler that names the destination."""
    err = one_line_error(capsys, main(["report", str(run_dir), "--html", "/proc/x.html"]),
                         "'/proc/x.html'")  # fmt: skip
    assert ".tmp" not in err and "/proc/.x.html" not in err


def test_the_validators_warnings_are_in_the_report(tmp_path):
    """The Compliance view listed the validator's warnings; the report left them out."""
    run = make_dashboard_run(tmp_path / "run", ranks=2, seconds=2.0)
    append_steps(run, ranks=3, first_step=8, count=2)  # rank 2: steps but no runs row
    assert main(["report", str(run), "--html", str(tmp_path / "r.html")]) == 0
    text = (tmp_path / "r.html").read_text()
    assert "warning: rank 2 has data but no row in the runs table" in text


def test_a_damaged_segment_a_compaction_holds_is_not_called_missing(tmp_path):
    """After a compaction the views read run.duckdb's rows that no readable segment holds:
    "their rows are missing from every figure" was false. Said as the CLI says it."""
    from trainspec.store import compact

    run = make_dashboard_run(tmp_path / "run", ranks=2, seconds=4.0)
    compact(run)
    _scramble_pages(sorted((run / "segments" / "steps").rglob("seg-*.parquet"))[0])
    assert main(["report", str(run), "--html", str(tmp_path / "r.html")]) == 0
    text = (tmp_path / "r.html").read_text()
    assert "could not be read; their rows are missing from every figure below unless " \
           "run.duckdb holds them" in text  # fmt: skip
    facts = dict(row for row in _facts(text))
    assert facts["steps"] == "16"  # and they are there: read from run.duckdb


def _facts(text: str) -> list[list[str]]:
    """The report's first table (the run's facts) read back: [name, value] rows."""
    sections = _Sections()
    sections.feed(text)
    return [row for row in sections.rows[""] if len(row) == 2]


def test_a_report_to_a_fifo_or_device_is_written_to_it_not_renamed_over_it(run_dir, tmp_path):
    """`--html /dev/null` as root renamed a regular file over /dev/null, for every process of
    the machine (a clean-clone CI run failed on what others then wrote there). Shown on a
    FIFO, which a rename would replace the same way: it stays a FIFO and gets the report."""
    import os
    import stat
    import threading

    fifo = tmp_path / "out.html"
    os.mkfifo(fifo)
    got: list[bytes] = []
    reader = threading.Thread(target=lambda: got.append(fifo.read_bytes()), daemon=True)
    reader.start()
    assert main(["report", str(run_dir), "--html", str(fifo)]) == 0
    is_fifo = stat.S_ISFIFO(os.stat(fifo).st_mode)
    if not is_fifo:  # renamed over: let the reader go, it waits on the FIFO it opened
        with contextlib.suppress(OSError):
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
    reader.join(10)
    assert is_fifo and stat.S_ISFIFO(os.stat(fifo).st_mode)
    assert got and b"<html" in got[0][:500].lower(), got[:1]


def test_actions_a_restart_rolled_back_are_marked_in_the_report(tmp_path):
    """QA bug 7: the killed attempt's actions were listed as if in effect."""
    from tests.unit.test_dashboard_data import restarted

    run = make_dashboard_run(tmp_path / "resumed", ranks=2, seconds=20.0)
    restarted(run, 2, loaded_step=50)
    out = tmp_path / "r.html"
    assert main(["report", str(run), "--html", str(out)]) == 0
    text = out.read_text()
    sections = _Sections()
    sections.feed(text)
    header, *rows = sections.rows["Anomalies and actions"]
    cells = [dict(zip(header, row)) for row in rows]
    marks = [(c["name"], c["step"], c["rolled back"]) for c in cells if c["kind"] == "action"]
    assert marks == [
        ("rebalance", "40", ""),
        ("compression", "64", "yes: a restart resumed from step 50"),
        ("compression", "64", ""),
    ]
    assert "1 action(s) marked" in text
