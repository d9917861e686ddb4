"""Bad input, one line and a non-zero exit, nothing stored lost:

- `trainspec report RUN/run.duckdb --html RUN/segments/...` overwrote a segment (only the
  file itself was protected), and a hard link to run.duckdb given as `--html` was written
  through: the report is now written beside its destination and renamed over it.
- `trainspec demo` launched torchrun with a TRAINSPEC_INJECT every rank refuses; the fault
  parser let `factor=inf` (the rank died in time.sleep) and `factor=nan` through.
- the agent printed socketserver's traceback for every connection a client reset.
- `trainspec query RUN ""` printed an empty line and exited 0.
"""

from __future__ import annotations

import logging
import os
import shutil
import socket
import struct
import time

import pytest

from tests.helpers.cli import one_line_error
from tests.helpers.dashboard_runs import make_dashboard_run
from trainspec.cli import demo
from trainspec.cli.main import main
from trainspec.runtime import inject
from trainspec.runtime.inject import FaultPlan, Injector, InjectSpecError

# --- trainspec report ------------------------------------------------------------------


@pytest.fixture(scope="module")
def source_run(tmp_path_factory):
    from trainspec.store import compact

    run = make_dashboard_run(tmp_path_factory.mktemp("src") / "run", ranks=1, seconds=5.0)
    compact(run)
    return run


@pytest.fixture
def run(source_run, tmp_path):
    """A copy of a compacted run with its segments: each test may try to destroy it."""
    return shutil.copytree(source_run, tmp_path / "run")


def _stored(run):
    return {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}


def _segment(run):
    return sorted((run / "segments" / "steps").rglob("seg-*.parquet"))[0]


@pytest.mark.parametrize("flag", ["--html", "--png"])
def test_report_on_run_duckdb_never_writes_into_its_segments(run, capsys, flag):
    """The run given as RUN/run.duckdb: RUN/segments is stored data too."""
    before = _stored(run)
    target = _segment(run) if flag == "--html" else _segment(run).parent
    code = main(["report", str(run / "run.duckdb"), flag, str(target)])
    one_line_error(capsys, code, "inside the run's stored data")
    assert _stored(run) == before


def test_report_never_writes_into_another_runs_store(run, source_run, tmp_path, capsys):
    other = shutil.copytree(source_run, tmp_path / "other")
    before = _stored(other)
    for target in (_segment(other), other / "run.duckdb"):
        code = main(["report", str(run), "--html", str(target)])
        one_line_error(capsys, code, "inside the run's stored data")
    assert _stored(other) == before


def test_a_hard_link_to_run_duckdb_as_html_is_replaced_not_written_through(run, tmp_path):
    before = _stored(run)
    link = tmp_path / "x.html"
    os.link(run / "run.duckdb", link)
    assert main(["report", str(run), "--html", str(link)]) == 0
    assert _stored(run) == before
    assert link.read_text().startswith("<!doctype html>")
    assert not (run / "run.duckdb").samefile(link)


def test_png_files_that_link_into_the_store_do_not_destroy_it(run, tmp_path, capsys):
    before = _stored(run)
    plots = tmp_path / "plots"
    plots.mkdir()
    os.link(_segment(run), plots / "series.png")  # a hard link: replaced
    assert main(["report", str(run), "--png", str(plots)]) == 0
    assert _stored(run) == before
    assert (plots / "series.png").read_bytes()[:4] == b"\x89PNG"
    (plots / "heatmap.png").unlink()
    (plots / "heatmap.png").symlink_to(_segment(run))  # a symbolic link: refused
    code = main(["report", str(run), "--png", str(plots)])
    one_line_error(capsys, code, "heatmap.png", "inside the run's stored data")
    assert _stored(run) == before


def test_a_lone_duckdb_file_may_have_a_report_beside_it(run, tmp_path):
    """Only a run directory's own files are protected, not a lone file's folder."""
    lone = tmp_path / "lone"
    lone.mkdir()
    shutil.copy(run / "run.duckdb", lone / "copy.duckdb")
    assert main(["report", str(lone / "copy.duckdb"), "--html", str(lone / "r.html")]) == 0
    assert (lone / "r.html").read_text().startswith("<!doctype html>")


def test_a_failed_report_leaves_the_old_file_and_no_partial_one(run, tmp_path, monkeypatch, capsys):
    from trainspec.dashboards import report

    out = tmp_path / "r.html"
    out.write_text("the previous report")

    def disk_full(fd):  # the disk fills as the written bytes reach it
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(report.os, "fsync", disk_full)
    code = main(["report", str(run), "--html", str(out)])
    err = one_line_error(capsys, code, "No space left on device", str(out))
    assert ".tmp" not in err
    assert out.read_text() == "the previous report"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.html", "run"]


# --- TRAINSPEC_INJECT --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("spec", "named"),
    [
        ("slow:rank=1,factor=inf", "field factor in 'slow:rank=1,factor=inf' must be a finite"),
        ("slow:rank=1,factor=nan", "field factor in 'slow:rank=1,factor=nan' must be a finite"),
        ("slow:rank=1,factor=-inf", "slow factor must be >= 1"),
        ("spike:step=3,factor=nan", "field factor in 'spike:step=3,factor=nan' must be a finite"),
        ("latency:rank=0,step=1,ms=inf", "latency ms must be a positive number"),
        ("squeeze:rank=0,pressure=nan", "squeeze pressure must be in"),
        ("squeeze:rank=0,bytes=inf", "field bytes in"),
        ("kill:rank=nan,step=1", "field rank in"),
        ("kill:rank=0,step=inf", "field step in"),
    ],
)
def test_nan_and_inf_fields_are_refused_naming_the_field(spec, named):
    with pytest.raises(InjectSpecError) as exc:
        FaultPlan.parse(spec)
    assert named in str(exc.value)


def test_the_builder_refuses_a_non_finite_factor_too():
    with pytest.raises(InjectSpecError, match="field factor must be a finite number"):
        FaultPlan().slow(1, float("inf"))


def test_a_huge_slow_factor_sleeps_at_most_the_cap(monkeypatch):
    """time.sleep raises OverflowError past ~1e10 s: the rank must not die of it."""
    slept = []
    monkeypatch.setattr(inject.time, "sleep", slept.append)
    inj = Injector(FaultPlan.parse("slow:rank=0,factor=1e300"), rank=0, attempt=0)
    assert inj.after_compute(0, 0.5) == inject.MAX_SLOW_SLEEP_S
    assert slept == [inject.MAX_SLOW_SLEEP_S]


@pytest.fixture
def no_launch(monkeypatch):
    def launched(*args, **kwargs):
        raise AssertionError(f"launched {args[0] if args else kwargs}")

    monkeypatch.setattr(demo.subprocess, "Popen", launched)
    for name in ("TRAINSPEC_CONFIG", "TRAINSPEC_COLLECTOR_PROMETHEUS_PORT"):
        monkeypatch.delenv(name, raising=False)


@pytest.mark.parametrize(
    ("spec", "allow", "needles"),
    [
        ("bogus", "1", ("TRAINSPEC_INJECT", "unknown fault kind 'bogus'")),
        ("kill:rank=x,step=1", "1", ("TRAINSPEC_INJECT", "field rank", "not a number")),
        ("slow:rank=1,factor=inf", "1", ("field factor", "finite")),
        ("slow:rank=1,factor=2", None, ("TRAINSPEC_ALLOW_INJECT=1",)),
    ],
)
def test_demo_checks_trainspec_inject_before_launching(
    spec, allow, needles, no_launch, tmp_path, capsys, monkeypatch
):
    monkeypatch.setenv("TRAINSPEC_INJECT", spec)
    if allow is None:
        monkeypatch.delenv("TRAINSPEC_ALLOW_INJECT", raising=False)
    else:
        monkeypatch.setenv("TRAINSPEC_ALLOW_INJECT", allow)
    code = main(["demo", "--ranks", "2", "--steps", "5", "--out", str(tmp_path / "d")])
    one_line_error(capsys, code, *needles)
    assert not (tmp_path / "d").exists()


# --- the agent's HTTP server -------------------------------------------------------------


@pytest.fixture
def agent_server():
    from trainspec.agent.ingest import IngestCounters
    from trainspec.agent.server import Response, make_server, serve

    routes = {("GET", "/ok"): lambda req: Response.json({"ok": True})}
    server = make_server(
        "127.0.0.1", 0, routes, token="", max_body_bytes=1024, counters=IngestCounters()
    )
    serve(server)
    yield server
    server.shutdown()
    server.server_close()


def _reset(port: int, payload: bytes = b"") -> None:
    s = socket.create_connection(("127.0.0.1", port))
    if payload:
        s.sendall(payload)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    s.close()


def test_a_client_reset_is_one_debug_line_not_a_traceback(agent_server, capfd, caplog):
    caplog.set_level(logging.DEBUG, logger="trainspec.agent")
    port = agent_server.server_address[1]
    _reset(port)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and not any("dropped" in r.message for r in caplog.records):
        time.sleep(0.02)
    err = capfd.readouterr().err
    assert "Traceback" not in err and "ConnectionResetError" not in err, err
    dropped = [r for r in caplog.records if "dropped its connection" in r.message]
    assert len(dropped) == 1 and dropped[0].levelno == logging.DEBUG
    assert dropped[0].exc_info is None
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_an_unexpected_handler_error_is_one_warning_line(agent_server, capfd, caplog):
    caplog.set_level(logging.DEBUG, logger="trainspec.agent")
    try:
        raise RuntimeError("something odd")
    except RuntimeError:
        agent_server.handle_error(None, ("10.0.0.1", 4242))
    assert "Traceback" not in capfd.readouterr().err
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    line = warnings[0].getMessage()
    assert "RuntimeError: something odd" in line and "10.0.0.1:4242" in line
    assert "\n" not in line and warnings[0].exc_info is None
    assert any(r.levelno == logging.DEBUG and r.exc_info for r in caplog.records)


# --- trainspec query ---------------------------------------------------------------------


@pytest.mark.parametrize("sql", ["", "   ", ";", " ; ;", "-- comment", "/* nothing */"])
def test_query_without_a_statement_is_an_error(source_run, capsys, sql):
    code = main(["query", str(source_run), sql])
    one_line_error(capsys, code, "no SQL statement")
    assert capsys.readouterr().out == ""


def test_query_with_a_statement_and_a_comment_still_runs(source_run, capsys):
    assert main(["query", str(source_run), "SELECT count(*) AS n FROM steps; -- rows"]) == 0
    assert "n" in capsys.readouterr().out
