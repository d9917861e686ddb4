"""The rank side of sidecar mode: batches go to the agent, or to the rank's own segments."""

from __future__ import annotations

import contextlib
import time

import pyarrow as pa
import pytest

import trainspec.store as store
from tests.integration.jobs import free_port
from tests.unit.agent_fixtures import running_agent
from trainspec.collector.records import Batch, EventRecord, StepRecord
from trainspec.collector.sinks.agent import (
    AgentSink,
    BatchFormatError,
    agent_endpoint,
    decode_tables,
    encode_tables,
)
from trainspec.store.tables import SAMPLES


def _batch(rank: int, start: float, n: int = 20) -> Batch:
    rows = [
        {"ts": start + i * 0.05, "rank": rank, "metric": "trainspec.host.memory.used",
         "value": float(i), "attrs": "{}"}
        for i in range(n)
    ]  # fmt: skip
    steps = [StepRecord(ts=start, rank=rank, step=int(start), duration_s=0.1, loss=1.5)]
    events = [EventRecord(ts=start, rank=rank, step=0, kind="anomaly", name="spike", reason="x",
                          evidence={"z": 4.0})]  # fmt: skip
    return Batch(pa.Table.from_pylist(rows, schema=SAMPLES), steps, events)


def test_frames_round_trip_and_reject_damage():
    batch = _batch(1, 100.0)
    tables = {
        "samples": batch.samples,
        "steps": batch.steps_table(),
        "events": batch.events_table(),
    }
    back = decode_tables(encode_tables(tables))
    for name, table in tables.items():
        assert back[name].equals(table)
    body = encode_tables(tables)
    for bad in (body[:3], body[:-1], body + b"\0", b"\xff\xff\xff\x7f" + body[4:]):
        with pytest.raises(BatchFormatError):
            decode_tables(bad)


def test_endpoint_comes_from_config_then_otel_variable():
    assert (
        agent_endpoint("http://a:1", {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://b:2"}) == "http://a:1"
    )
    assert agent_endpoint("", {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://b:2"}) == "http://b:2"
    assert agent_endpoint("", {}) == "http://127.0.0.1:4318"
    with pytest.raises(ValueError, match="not an http"):
        AgentSink("https://x", run_id="r", rank=0, run_dir="/tmp/x", writer="rank-0")


def _counts(run_dir) -> dict[str, list]:
    con = store.open(run_dir)
    return {
        t: con.execute(f"SELECT count(*) FROM {t}").fetchall()[0][0]
        for t in ("samples", "steps", "events")
    }


def test_agent_down_then_up_then_down_loses_nothing(tmp_path):
    """Fail open: no agent -> own segments; agent back -> it writes; killed -> own again."""
    port = free_port()
    run_dir = tmp_path / "run-x"
    sink = AgentSink(f"http://127.0.0.1:{port}", run_id="run-x", rank=0, run_dir=run_dir,
                     writer="rank-0", timeout_s=1.0, retry_after_s=0.0)  # fmt: skip
    sink.write(_batch(0, 1.0))  # no agent yet
    assert sink.fallback_batches == 1 and sink.sent_batches == 0
    with running_agent(tmp_path, listen=f"127.0.0.1:{port}", nvml=False) as agent:
        sink.write(_batch(0, 2.0))
        sink.write(_batch(0, 3.0))
        assert sink.sent_batches == 2
        writer_dir = run_dir / "segments" / "samples" / agent.store.writer_id
        assert writer_dir.is_dir()
    sink.write(_batch(0, 4.0))  # agent gone again
    sink.close()
    assert sink.fallback_batches == 2
    counts = _counts(run_dir)
    assert counts["steps"] == 4 and counts["events"] == 4
    con = store.open(run_dir)
    by_rank = dict(con.execute("SELECT rank, count(*) FROM samples GROUP BY rank").fetchall())
    assert by_rank == {0: 80}  # every batch exactly once, whoever wrote it
    ev = con.execute("SELECT evidence FROM events ORDER BY ts").fetchall()
    assert all('"z": 4.0' in e[0] for e in ev)


def test_a_silent_agent_costs_at_most_the_timeout_and_loses_nothing(tmp_path):
    # A listening socket that never answers: the sink gives up after timeout_s. The batch may
    # have been stored (the outcome is unknown), so it is held for a re-send; the next batch,
    # inside retry_after_s, goes to the rank's own segments; at close the held one is tried
    # once more and, still unanswered, written there too.
    import socket

    with socket.socket() as srv:
        srv.bind(("127.0.0.1", 0))
        srv.listen(4)
        port = srv.getsockname()[1]
        sink = AgentSink(f"http://127.0.0.1:{port}", run_id="slow", rank=1,
                         run_dir=tmp_path / "slow", writer="rank-1", timeout_s=0.5)  # fmt: skip
        t0 = time.monotonic()
        sink.write(_batch(1, 5.0))
        assert time.monotonic() - t0 < 2.0
        assert (sink.fallback_batches, len(sink._unsettled)) == (0, 1)
        sink.write(_batch(1, 6.0))
        assert time.monotonic() - t0 < 2.0
        assert (sink.fallback_batches, len(sink._unsettled)) == (1, 1)
        sink.close()
        assert (sink.fallback_batches, len(sink._unsettled)) == (2, 0)
    assert _counts(tmp_path / "slow")["samples"] == 40


def _slow_commits(monkeypatch, seconds: float) -> None:
    from trainspec.agent.writer import StoreWriter

    commit_run = StoreWriter._commit_run

    def slow(self, run_id, tables):
        time.sleep(seconds)
        return commit_run(self, run_id, tables)

    monkeypatch.setattr(StoreWriter, "_commit_run", slow)


def test_a_batch_whose_answer_timed_out_is_stored_once(tmp_path, monkeypatch):
    """The agent stores the batch after the rank stopped waiting for its answer. The rank
    holds it and re-sends it under the same id; the agent answers from its first commit."""
    _slow_commits(monkeypatch, 1.5)
    run_dir = tmp_path / "late"
    with running_agent(tmp_path, nvml=False, commit_interval_s=0.05) as agent:
        sink = AgentSink(f"http://127.0.0.1:{agent.port}", run_id="late", rank=0,
                         run_dir=run_dir, writer="rank-0", timeout_s=0.8,
                         retry_after_s=0.0)  # fmt: skip
        sink.write(_batch(0, 1.0))  # its commit starts at once and ends after the rank gave up
        assert len(sink._unsettled) == 1 and sink.fallback_batches == 0
        deadline = time.monotonic() + 10
        while agent.store.rows_written < 22 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert agent.store.rows_written == 22  # 20 samples, 1 step, 1 event: stored once
        monkeypatch.undo()
        sink.write(_batch(0, 2.0))
        sink.close()
        assert (sink.resent_batches, sink.sent_batches, sink.fallback_batches) == (1, 1, 0)
        assert agent.counters.accepted_requests["batch_resent"] == 1
    con = store.open(run_dir)
    by_rank = dict(con.execute("SELECT rank, count(*) FROM samples GROUP BY rank").fetchall())
    assert by_rank == {0: 40}  # each batch once
    assert _counts(run_dir)["steps"] == 2


def test_a_batch_withdrawn_before_its_commit_is_not_stored_by_the_agent(tmp_path, monkeypatch):
    """A 503 means "not stored, and never will be": the rank writes the batch itself, and
    the agent's later commit does not write it again."""
    import trainspec.agent.app as app
    from trainspec.agent.writer import StoreWriter

    monkeypatch.setattr(app, "COMMIT_WAIT_S", 0.2)
    run_dir = tmp_path / "stuck"
    with running_agent(tmp_path, nvml=False, commit_interval_s=0.1) as agent:
        monkeypatch.setattr(StoreWriter, "commit", lambda self: None)  # a stuck commit thread
        sink = AgentSink(f"http://127.0.0.1:{agent.port}", run_id="stuck", rank=0,
                         run_dir=run_dir, writer="rank-0", timeout_s=5.0)  # fmt: skip
        sink.write(_batch(0, 1.0))
        assert (sink.fallback_batches, len(sink._unsettled)) == (1, 0)
        assert agent.store.pending() == 0
        sink.close()
        monkeypatch.undo()  # the agent's close commits what is pending: nothing of that batch
    assert agent.store.rows_written == 0  # the agent's final commit had nothing of it
    assert _counts(run_dir) == {"samples": 20, "steps": 1, "events": 1}


def test_node_gpu_rows_become_the_ranks_own():
    from trainspec.agent.gpu_owners import GpuOwners

    rows = [
        (1.0, "trainspec.gpu.utilization", 0.5, '{"gpu.index":0,"hw.id":"GPU-a"}'),
        (1.0, "trainspec.gpu.utilization", 0.7, '{"gpu.index":1,"hw.id":"GPU-b"}'),
        (1.0, "trainspec.gpu.utilization", 0.9, '{"gpu.index":2,"hw.id":"GPU-c"}'),
        (1.0, "trainspec.host.memory.used", 5.0, "{}"),
    ]
    table = pa.Table.from_pylist(
        [{"ts": t, "rank": -1, "metric": m, "value": v, "attrs": a} for t, m, v, a in rows],
        schema=SAMPLES,
    )
    owners = GpuOwners()
    assert owners.split(table) == ({}, table)  # no rank yet: all the node's
    for rank, local in ((4, 0), (5, 1)):  # this node holds ranks 4 and 5
        owners.saw_run_row("r", rank, local, "cuda")
        owners.saw_batch("r", rank, None, None)
    out, rest = owners.split(table)
    got = sorted((k[1], t["rank"][0].as_py(), t["value"][0].as_py()) for k, t in out.items())
    assert got == [(4, 4, 0.5), (5, 5, 0.7)]
    assert rest["value"].to_pylist() == [0.9, 5.0]


def test_writes_from_two_threads_are_each_stored_once(tmp_path):
    """A SIGTERM's flush on the main thread can race the flush thread: two batches once went
    out under one id, and the agent answered the second as a duplicate and dropped it."""
    import threading

    run_dir = tmp_path / "race"
    with running_agent(tmp_path, nvml=False) as agent:
        sink = AgentSink(f"http://127.0.0.1:{agent.port}", run_id="race", rank=0,
                         run_dir=run_dir, writer="rank-0", timeout_s=5.0)  # fmt: skip

        def write(first: int) -> None:
            for i in range(10):
                sink.write(_batch(0, float(first + i), n=5))

        threads = [threading.Thread(target=write, args=(start,)) for start in (100, 200)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        sink.close()
        sink.write(_batch(0, 300.0, n=5))  # after close: the rank's own segments
        assert agent.counters.accepted_requests["batch_resent"] == 0
    con = store.open(run_dir)
    assert con.execute("SELECT count(*), count(DISTINCT ts) FROM samples").fetchone() == (105, 105)


def _trickling_agent(stop) -> int:
    """A server that answers every request one header byte each 0.2 s, never finishing."""
    import socket
    import threading

    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(8)
    srv.settimeout(0.2)

    def serve() -> None:
        conns = []
        while not stop.is_set():
            try:
                conn, _ = srv.accept()
                conn.recv(1 << 20)
                conn.sendall(b"HTTP/1.1 200 OK\r\n")
                conns.append(conn)
            except OSError:
                pass
            for c in conns:
                with contextlib.suppress(OSError):
                    c.sendall(b"X")
        for c in conns:
            c.close()
        srv.close()

    threading.Thread(target=serve, daemon=True).start()
    return srv.getsockname()[1]


def test_a_trickling_agent_costs_one_deadline_not_for_ever(tmp_path):
    """Each byte came within the socket timeout, so no read timed out: the flush thread and
    then close() waited as long as the agent kept trickling. Now the whole exchange has the
    timeout as its deadline, and the run row waits for the first batch (it was sent from
    `trainspec.init`, on the training thread)."""
    import threading

    stop = threading.Event()
    port = _trickling_agent(stop)
    try:
        sink = AgentSink(f"http://127.0.0.1:{port}", run_id="trickle", rank=0,
                         run_dir=tmp_path / "trickle", writer="rank-0", timeout_s=0.5)  # fmt: skip
        row = _run_row()
        t0 = time.monotonic()
        sink.write_run_row(row)
        assert time.monotonic() - t0 < 0.1  # nothing sent from the caller's thread
        sink.write(_batch(0, 1.0))
        assert time.monotonic() - t0 < 1.5
        assert len(sink._unsettled) == 1 and sink.fallback_batches == 0
        sink.close()
        assert time.monotonic() - t0 < 3.0
    finally:
        stop.set()
    counts = _counts(tmp_path / "trickle")
    assert counts["samples"] == 20
    con = store.open(tmp_path / "trickle")
    assert con.execute("SELECT count(*) FROM runs").fetchone()[0] == 1


def _run_row() -> pa.Table:
    from trainspec.store.tables import RUNS

    row = {name: None for name in RUNS.names} | {"run_id": "trickle", "rank": 0}
    return pa.Table.from_pylist([row], schema=RUNS)


def test_a_send_that_fails_unexpectedly_falls_back_to_the_ranks_own_segments(tmp_path, monkeypatch):
    """An error other than the network's (an OverflowError from a timeout past what a wait
    takes, before config refused one) dropped every batch instead of writing it here."""
    import http.client

    def broken(*args, **kwargs):
        raise OverflowError("timestamp out of range for platform time_t")

    monkeypatch.setattr(http.client.HTTPConnection, "request", broken)
    run_dir = tmp_path / "run-o"
    sink = AgentSink(f"http://127.0.0.1:{free_port()}", run_id="run-o", rank=0,
                     run_dir=run_dir, writer="rank-0", timeout_s=1.0)  # fmt: skip
    sink.write(_batch(0, 1.0))
    sink.close()
    assert sink.fallback_batches == 1 and sink.sent_batches == 0
    assert _counts(run_dir)["steps"] == 1


@pytest.mark.parametrize("field", ["timeout_s", "retry_after_s"])
@pytest.mark.parametrize("value", [-1.0, 1e10, float("nan")])
def test_a_wait_no_timer_can_take_is_refused_naming_it(tmp_path, field, value):
    from trainspec.collector.sinks.agent import LONGEST_WAIT_S
    from trainspec.config_rules import SECONDS_MAX

    assert LONGEST_WAIT_S == SECONDS_MAX  # the sink refuses what config refuses
    with pytest.raises(ValueError, match=field):
        AgentSink("http://127.0.0.1:1", run_id="r", rank=0, run_dir=tmp_path,
                  writer="rank-0", **{field: value})  # fmt: skip


def test_a_failed_fallback_merge_leaves_every_table_written(tmp_path, monkeypatch, caplog):
    """A merge that fails (a full disk, no threads left for DuckDB) is housekeeping: the
    batch's other tables are still written, and the failure is counted and said once."""
    import trainspec.store.segments as segments

    def no_duckdb():
        raise store.StoreError("cannot open DuckDB to merge segments: out of threads")

    monkeypatch.setattr(segments, "_merge_connection", no_duckdb)
    run_dir = tmp_path / "run-x"
    sink = AgentSink(f"http://127.0.0.1:{free_port()}", run_id="run-x", rank=0,
                     run_dir=run_dir, writer="rank-0", timeout_s=1.0, retry_after_s=0.0,
                     fanout=2)  # fmt: skip
    with caplog.at_level("WARNING", logger="trainspec.collector"):
        for t in range(3):  # no agent: every batch to the rank's own segments
            sink.write(_batch(0, float(t)))
    sink.close()
    assert sink.fallback_batches == 3
    assert _counts(run_dir)["steps"] == 3 and _counts(run_dir)["events"] == 3
    said = [r for r in caplog.records if "merging" in r.getMessage()]
    assert len(said) == 1


def test_an_agent_refusing_the_token_is_said_in_one_line_naming_it(tmp_path, caplog):
    """A wrong token was reported as the agent being unavailable, the warning split in two
    by the newline that ends the agent's answer."""
    with running_agent(tmp_path, token="right-token") as agent:
        port = agent.server.server_address[1]
        sink = AgentSink(f"http://127.0.0.1:{port}", run_id="run-t", rank=0,
                         run_dir=tmp_path / "run-t", writer="rank-0", timeout_s=2.0,
                         retry_after_s=60.0, token="wrong")  # fmt: skip
        sink.write(_batch(0, 1.0))
        sink.close()
    assert sink.fallback_batches == 1  # stored by the rank itself
    line = next(r.getMessage() for r in caplog.records if "agent at" in r.getMessage())
    assert "\n" not in line and "401" in line and "TRAINSPEC_AGENT_TOKEN" in line
