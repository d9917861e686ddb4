"""OTLP and raw-batch ingest: good bodies are taken, bad ones get 4xx, are counted, and the
agent keeps serving (property-based: hypothesis, bounded examples)."""

from __future__ import annotations

import gzip
import http.client
import json
import socket
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import trainspec.store as store
from tests.helpers.payloads import otlp_json, otlp_request
from tests.helpers.runs import synthetic_run
from tests.unit.agent_fixtures import call, running_agent
from trainspec.collector.sinks.agent import BATCH_CONTENT_TYPE, decode_tables, encode_tables
from trainspec.schema.targets import TargetError, decode_otlp
from trainspec.store.tables import SAMPLES

PROTO = {"Content-Type": "application/x-protobuf"}
VALID = otlp_request(synthetic_run(1, 0.2)).SerializeToString()


@pytest.fixture(scope="module")
def agent(tmp_path_factory):
    with running_agent(tmp_path_factory.mktemp("store"), max_body_bytes=256 * 1024) as a:
        yield a


def _rejected(agent, reason: str) -> int:
    return agent.counters.snapshot()["rejected"].get(reason, 0)


def test_valid_protobuf_json_and_gzip_are_accepted(agent):
    assert call(agent.port, "POST", "/v1/metrics", VALID, PROTO)[0] == 200
    body = otlp_json(otlp_request(synthetic_run(1, 0.2)))
    assert (
        call(agent.port, "POST", "/v1/metrics", body, {"Content-Type": "application/json"})[0]
        == 200
    )
    gz = {**PROTO, "Content-Encoding": "gzip"}
    assert call(agent.port, "POST", "/v1/metrics", gzip.compress(VALID), gz)[0] == 200
    # The points reached /metrics under the rank's resource labels.
    _, text = call(agent.port, "GET", "/metrics")
    assert b"trainspec_host_memory_used_bytes{" in text


@pytest.mark.parametrize(
    ("body", "headers", "status", "reason"),
    [
        (VALID, {"Content-Type": "text/plain"}, 415, "content_type"),
        (VALID, {}, 415, "content_type"),
        (b"", PROTO, 400, "empty"),
        (b"\xff\x00garbage" * 10, PROTO, 400, "otlp_decode"),
        (b"{not json", {"Content-Type": "application/json"}, 400, "otlp_decode"),
        (VALID, {**PROTO, "Content-Encoding": "br"}, 415, "encoding"),
        (gzip.compress(VALID)[:-9], {**PROTO, "Content-Encoding": "gzip"}, 400, "gzip"),
        (b"x" * (256 * 1024 + 1), PROTO, 413, "too_large"),
        # A gzip bomb: 40 KiB on the wire, past the limit once inflated.
        (gzip.compress(b"\0" * (8 << 20)), {**PROTO, "Content-Encoding": "gzip"}, 413,
         "too_large"),
    ],
)  # fmt: skip
def test_bad_bodies_are_refused_and_counted(agent, body, headers, status, reason):
    before = _rejected(agent, reason)
    got, raw = call(agent.port, "POST", "/v1/metrics", body, headers)
    assert got == status, raw
    assert _rejected(agent, reason) == before + 1
    assert call(agent.port, "GET", "/healthz")[0] == 200


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(body=st.binary(min_size=1, max_size=2048))
def test_fuzzed_bodies_never_crash_the_agent(agent, body):
    status, _ = call(agent.port, "POST", "/v1/metrics", body, PROTO)
    try:
        decode_otlp(body, "application/x-protobuf")
        assert status == 200
    except TargetError:
        assert 400 <= status < 500
    assert _rejected(agent, "internal") == 0


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(cut=st.integers(min_value=0, max_value=len(VALID) - 1))
def test_truncated_otlp_is_refused_unless_it_is_still_a_request(agent, cut):
    body = VALID[:cut]
    status, _ = call(agent.port, "POST", "/v1/metrics", body, PROTO)
    try:
        decode_otlp(body, "application/x-protobuf")
        assert status == 200  # cut at a message boundary: still a (shorter) request
    except TargetError:
        assert 400 <= status < 500


def _batch_body(rank: int, n: int = 5) -> bytes:
    import pyarrow as pa

    now = time.time()
    rows = [
        {"ts": now + i * 0.05, "rank": rank, "metric": "trainspec.host.cpu.utilization",
         "value": 0.1 * i, "attrs": "{}"}
        for i in range(n)
    ]  # fmt: skip
    return encode_tables({"samples": pa.Table.from_pylist(rows, schema=SAMPLES)})


def test_batch_is_durable_when_acknowledged(agent):
    headers = {"Content-Type": BATCH_CONTENT_TYPE, "X-Trainspec-Run-Id": "ack-run",
               "X-Trainspec-Rank": "3"}  # fmt: skip
    status, _ = call(agent.port, "POST", "/v1/trainspec/batches", _batch_body(3), headers)
    assert status == 200
    # No wait: the 200 came after the segment was renamed into place.
    con = store.open(agent.settings.store + "/ack-run")
    assert con.execute("SELECT count(*) FROM samples WHERE rank = 3").fetchone()[0] == 5


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(cut=st.integers(min_value=0, max_value=400), junk=st.binary(max_size=64))
def test_damaged_batches_get_400(agent, cut, junk):
    body = _batch_body(0)
    damaged = body[:cut] + junk if cut < len(body) else body + (junk or b"x")
    headers = {"Content-Type": BATCH_CONTENT_TYPE, "X-Trainspec-Run-Id": "fuzz",
               "X-Trainspec-Rank": "0"}  # fmt: skip
    status, _ = call(agent.port, "POST", "/v1/trainspec/batches", damaged, headers)
    assert status in (200, 400)
    if damaged != body:
        assert status == 400 or damaged[: len(body)] == body  # never a silent half-read
    assert call(agent.port, "GET", "/healthz")[0] == 200


@pytest.mark.parametrize(
    ("run_id", "rank"), [("../escape", "0"), ("a/b", "0"), ("", "0"), ("ok", "x"), (".hidden", "1")]
)
def test_batch_headers_cannot_escape_the_store(agent, run_id, rank):
    headers = {"Content-Type": BATCH_CONTENT_TYPE, "X-Trainspec-Run-Id": run_id,
               "X-Trainspec-Rank": rank}  # fmt: skip
    status, _ = call(agent.port, "POST", "/v1/trainspec/batches", _batch_body(0), headers)
    assert status == 400


@pytest.mark.parametrize("batch_id", ["", "a b", "x" * 65, "../x", "id\u00e9"])
def test_a_bad_batch_id_gets_400_and_nothing_is_stored(agent, batch_id):
    headers = {**_batch_headers("bad-batch-id", "0"), "X-Trainspec-Batch": batch_id}
    status, body = call(agent.port, "POST", "/v1/trainspec/batches", _batch_body(0), headers)
    assert status == 400 and b"X-Trainspec-Batch" in body
    assert not (Path(agent.settings.store) / "bad-batch-id").exists()


def test_the_same_batch_id_twice_is_stored_once(agent):
    headers = {**_batch_headers("twice", "2"), "X-Trainspec-Batch": "2-99-abc-1"}
    body = _batch_body(2)
    first = call(agent.port, "POST", "/v1/trainspec/batches", body, headers)
    second = call(agent.port, "POST", "/v1/trainspec/batches", body, headers)
    assert first[0] == second[0] == 200
    assert json.loads(second[1]) == {"rows": 5, "duplicate": True}
    other = {**headers, "X-Trainspec-Batch": "2-99-abc-2"}  # another id: another batch
    assert call(agent.port, "POST", "/v1/trainspec/batches", body, other)[0] == 200
    con = store.open(agent.settings.store + "/twice")
    assert con.execute("SELECT count(*) FROM samples").fetchone()[0] == 10


def test_an_id_reused_for_another_body_is_refused_and_nothing_is_dropped(agent):
    """The second body was answered 200 "duplicate" and its rows thrown away."""
    headers = {**_batch_headers("reused", "0"), "X-Trainspec-Batch": "same"}
    assert call(agent.port, "POST", "/v1/trainspec/batches", _batch_body(0, n=3), headers)[0] == 200
    status, body = call(agent.port, "POST", "/v1/trainspec/batches", _batch_body(0, n=4), headers)
    assert status == 422 and b"used for another body" in body
    con = store.open(agent.settings.store + "/reused")
    assert con.execute("SELECT count(*) FROM samples").fetchone()[0] == 3


def test_a_batch_read_after_its_deadline_is_refused_unstored(agent):
    """An agent stopped (SIGSTOP) while ranks sent: they gave up and wrote their batches
    themselves, and the agent, resumed, stored the requests still queued in its socket."""
    late = {**_batch_headers("late-batch", "0"), "X-Trainspec-Batch": "x-1",
            "X-Trainspec-Deadline": f"{time.time() - 5:.3f}"}  # fmt: skip
    status, body = call(agent.port, "POST", "/v1/trainspec/batches", _batch_body(0), late)
    assert status == 503 and b"after its deadline" in body
    assert not (Path(agent.settings.store) / "late-batch").exists()
    on_time = {**late, "X-Trainspec-Deadline": f"{time.time() + 10:.3f}"}
    assert call(agent.port, "POST", "/v1/trainspec/batches", _batch_body(0), on_time)[0] == 200
    bad = {**late, "X-Trainspec-Deadline": "soon"}
    assert call(agent.port, "POST", "/v1/trainspec/batches", _batch_body(0), bad)[0] == 400


def test_a_withdrawn_batch_is_never_committed(tmp_path):
    from trainspec.agent.writer import StoreWriter
    from trainspec.store.tables import EVENTS

    writer = StoreWriter(tmp_path, "n1", commit_interval_s=60, pending_rows=1000)
    samples = decode_tables(_batch_body(0))["samples"]
    events = decode_tables(_event_body(0, '{"a": 1}'))["events"]
    assert events.schema.equals(EVENTS)
    kept = writer.submit("run", {"samples": samples})
    taken = writer.submit("run", {"samples": samples.slice(0, 2), "events": events})
    assert writer.withdraw(taken) and writer.pending() == 5
    assert taken.parts == []
    writer.commit()  # the events list it emptied must not fail the run's commit
    assert kept.cycle.error is None and writer.healthy()
    assert not writer.withdraw(kept)  # committed: too late to take back
    assert kept.cycle.done.is_set() and writer.rows_written == 5
    assert kept.parts == []  # a committed ticket holds no rows (the ledger keeps tickets)
    assert not list((tmp_path / "run" / "segments").glob("events/*/seg-*"))
    writer.close()


def _answer(port: int, method: str, path: str) -> tuple[int, str | None, str | None, bytes]:
    """(status, Allow, Content-Type, body) of one request."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=15)
    try:
        conn.request(method, path)
        resp = conn.getresponse()
        return resp.status, resp.getheader("Allow"), resp.getheader("Content-Type"), resp.read()
    finally:
        conn.close()


@pytest.mark.parametrize(
    ("method", "path", "allow"),
    [
        ("GET", "/v1/metrics", "POST"),
        ("DELETE", "/v1/actions", "GET, POST"),
        ("PUT", "/v1/trainspec/batches", "POST"),
        ("PATCH", "/metrics", "GET"),
        ("OPTIONS", "/healthz", "GET"),
        ("BREW", "/v1/status", "GET"),  # a method http.server has never heard of
    ],
)
def test_a_method_the_route_does_not_serve_gets_a_json_405_with_allow(agent, method, path, allow):
    before = _rejected(agent, "route")
    status, allowed, content_type, body = _answer(agent.port, method, path)
    assert (status, allowed, content_type) == (405, allow, "application/json")
    assert method in json.loads(body)["error"]
    assert _rejected(agent, "route") == before + 1
    assert call(agent.port, "GET", "/healthz")[0] == 200


def test_head_gets_405_headers_without_a_body(agent):
    status, allowed, _, body = _answer(agent.port, "HEAD", "/metrics")
    assert (status, allowed, body) == (405, "GET", b"")


@pytest.mark.parametrize("method", ["GET", "DELETE", "POST"])
def test_an_unknown_path_gets_a_json_404(agent, method):
    status, allowed, content_type, body = _answer(agent.port, method, "/nope")
    assert (status, allowed, content_type) == (404, None, "application/json")
    assert "/nope" in json.loads(body)["error"]


def test_a_request_http_server_cannot_parse_gets_a_json_refusal(agent):
    before = _rejected(agent, "protocol")
    with socket.create_connection(("127.0.0.1", agent.port), timeout=15) as sock:
        # A request line past http.server's 65536 bytes, sent whole so that nothing is left
        # unread (closing on unread bytes would reset the connection before the answer).
        sock.sendall(b"GET /" + b"a" * 65_532)
        raw = b""
        while chunk := sock.recv(4096):
            raw += chunk
    head, _, body = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 414 ") and b"Content-Type: application/json" in head
    assert "error" in json.loads(body)
    assert _rejected(agent, "protocol") == before + 1


def test_hostile_attribute_keys_cannot_break_the_exposition(tmp_path):
    """One sender's bad label names must not make /metrics unparseable for every source."""
    import shutil
    import subprocess

    from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
        ExportMetricsServiceRequest,
    )
    from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue

    req = ExportMetricsServiceRequest()
    rm = req.resource_metrics.add()
    rm.resource.attributes.append(KeyValue(key="trainspec.rank", value=AnyValue(int_value=7)))
    rm.resource.attributes.append(KeyValue(key="", value=AnyValue(string_value="r")))
    metric = rm.scope_metrics.add().metrics.add(name="trainspec.host.memory.used")
    dp = metric.gauge.data_points.add(time_unix_nano=1, as_double=1.0)
    for key in ("1bad", "", "__name__", "ok.key"):
        dp.attributes.append(KeyValue(key=key, value=AnyValue(string_value='v\n"')))
    with running_agent(tmp_path, nvml=False) as agent:
        assert call(agent.port, "POST", "/v1/metrics", req.SerializeToString(), PROTO)[0] == 200
        status, body = call(agent.port, "GET", "/metrics")
    assert status == 200
    line = next(x for x in body.decode().splitlines() if x.startswith("trainspec_host_memory"))
    assert 'ok_key="v\\n\\""' in line and "__name__" not in line and "{=" not in line
    promtool = shutil.which("promtool")
    if promtool:
        result = subprocess.run([promtool, "check", "metrics"], input=body, capture_output=True,
                                timeout=60)  # fmt: skip
        assert result.returncode == 0, (result.stdout + result.stderr).decode()


def _batch_headers(run_id: str, rank: str) -> dict[str, str]:
    return {"Content-Type": BATCH_CONTENT_TYPE, "X-Trainspec-Run-Id": run_id,
            "X-Trainspec-Rank": rank}  # fmt: skip


def _segments(run_dir) -> list:
    return sorted(run_dir.glob("segments/*/*/seg-*.parquet"))


def _event_body(rank: int, evidence: str | None, after: str | None = None) -> bytes:
    import pyarrow as pa

    from trainspec.store.tables import EVENTS

    event = {"ts": time.time(), "rank": rank, "step": 12, "kind": "checkpoint",
             "name": "periodic", "severity": "info", "reason": "x", "evidence": evidence,
             "before": None, "after": after}  # fmt: skip
    samples = pa.Table.from_pylist(
        [{"ts": time.time(), "rank": rank, "metric": "trainspec.host.cpu.utilization",
          "value": 0.5, "attrs": "{}"}], schema=SAMPLES)  # fmt: skip
    return encode_tables({"samples": samples, "events": pa.Table.from_pylist([event], EVENTS)})


@pytest.mark.parametrize(
    ("evidence", "after"),
    [('["model.pt"]', None), ('"[1]"', None), ("null", None), ("{not json", None),
     ("[" * 100_000 + "]" * 100_000, None), ("{}", "[1]")],
    ids=["list", "string", "null", "not-json", "nested-too-deeply", "after-list"],
)  # fmt: skip
def test_event_json_that_is_not_an_object_gets_400_before_anything_is_stored(
    agent, evidence, after
):
    run_dir = Path(agent.settings.store) / "bad-evidence"
    before = _rejected(agent, "event_json")
    status, raw = call(agent.port, "POST", "/v1/trainspec/batches", _event_body(2, evidence, after),
                       _batch_headers("bad-evidence", "2"))  # fmt: skip
    assert status == 400, raw
    assert "event 0 (checkpoint/periodic, step 12)" in json.loads(raw)["error"]
    assert _rejected(agent, "event_json") == before + 1
    time.sleep(2 * agent.settings.commit_interval_s)  # a queued batch would be written by now
    assert _segments(run_dir) == []  # the sender writes it itself: nothing here to duplicate


def test_an_event_object_is_stored_and_counted_on_metrics(agent):
    body = _event_body(2, '{"bytes": 1024, "seconds": 0.5}')
    status, raw = call(agent.port, "POST", "/v1/trainspec/batches", body,
                       _batch_headers("good-evidence", "2"))  # fmt: skip
    assert status == 200, raw
    con = store.open(agent.settings.store + "/good-evidence")
    assert con.execute("SELECT count(*) FROM events").fetchone()[0] == 1


def test_a_metrics_feed_failure_never_fails_a_stored_batch(agent, monkeypatch):
    def broken(*args, **kwargs):
        raise AttributeError("'list' object has no attribute 'get'")

    monkeypatch.setattr(agent.book, "apply_batch", broken)
    before = _rejected(agent, "metrics_feed")
    for _ in range(2):  # counted each time, logged once
        status, raw = call(agent.port, "POST", "/v1/trainspec/batches", _batch_body(4),
                           _batch_headers("feed-broken", "4"))  # fmt: skip
        assert status == 200, raw  # a 500 here would make the rank write it a second time
    assert _rejected(agent, "metrics_feed") == before + 2
    con = store.open(agent.settings.store + "/feed-broken")
    assert con.execute("SELECT count(*) FROM samples").fetchone()[0] == 10


@pytest.mark.parametrize(
    ("header", "row_ranks", "message"),
    [
        ("-2", [-2], "X-Trainspec-Rank '-2'"),
        ("1000000000000000000000000000000", [0], "X-Trainspec-Rank '1000"),
        ("2147483648", [0], "X-Trainspec-Rank '2147483648'"),
        ("+3", [3], "X-Trainspec-Rank '+3'"),
        ("", [0], "X-Trainspec-Rank ''"),
        ("0", [0, 7], "samples row has rank 7 but X-Trainspec-Rank is 0"),
        ("0", [-4, 0], "samples row has rank -4 but X-Trainspec-Rank is 0"),
    ],
)
def test_impossible_or_mismatched_ranks_get_400_and_reach_nothing(agent, header, row_ranks,
                                                                  message):  # fmt: skip
    import pyarrow as pa

    rows = [{"ts": time.time(), "rank": r, "metric": "trainspec.host.cpu.utilization",
             "value": 0.5, "attrs": "{}"} for r in row_ranks]  # fmt: skip
    body = encode_tables({"samples": pa.Table.from_pylist(rows, schema=SAMPLES)})
    headers = {**_batch_headers("bad-rank", "x"), "X-Trainspec-Rank": header}
    status, raw = call(agent.port, "POST", "/v1/trainspec/batches", body, headers)
    assert status == 400, raw
    assert message in json.loads(raw)["error"]
    _, text = call(agent.port, "GET", "/metrics")
    assert b"bad-rank" not in text
    time.sleep(2 * agent.settings.commit_interval_s)
    assert _segments(Path(agent.settings.store) / "bad-rank") == []


def test_the_largest_rank_is_accepted(agent):
    rank = str(2**31 - 1)
    status, raw = call(agent.port, "POST", "/v1/trainspec/batches", _batch_body(2**31 - 1),
                       _batch_headers("top-rank", rank))  # fmt: skip
    assert status == 200, raw


def test_a_content_length_that_is_not_ascii_digits_gets_400(agent):
    """'²' passes str.isdigit() and int() refuses it: a 400, not a dropped connection."""
    before = _rejected(agent, "length")
    with socket.create_connection(("127.0.0.1", agent.port), timeout=15) as sock:
        sock.sendall("POST /v1/actions HTTP/1.1\r\nHost: x\r\nContent-Length: ²\r\n\r\n{}"
                     .encode("latin-1"))  # fmt: skip
        raw = b""
        while chunk := sock.recv(4096):
            raw += chunk
    head, _, body = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400 "), raw
    assert "Content-Length" in json.loads(body)["error"]
    assert _rejected(agent, "length") == before + 1
    assert _rejected(agent, "internal") == 0


def test_one_runs_failed_commit_fails_only_that_runs_batches(tmp_path):
    """Three ranks' batches in one commit cycle; one run's directory cannot be created."""
    import threading

    (tmp_path / "blocked").write_text("a plain file where the run directory would go")
    with running_agent(tmp_path, nvml=False, commit_interval_s=0.5) as agent:
        statuses: dict[str, int] = {}

        def send(run_id: str) -> None:
            statuses[run_id] = call(agent.port, "POST", "/v1/trainspec/batches", _batch_body(1),
                                    _batch_headers(run_id, "1"))[0]  # fmt: skip

        threads = [threading.Thread(target=send, args=(r,)) for r in ("aaa-good", "blocked",
                                                                         "zzz-good")]  # fmt: skip
        for t in threads:
            t.start()
        for t in threads:
            t.join(15)
        assert statuses == {"aaa-good": 200, "blocked": 503, "zzz-good": 200}
        for run_id in ("aaa-good", "zzz-good"):
            con = store.open(tmp_path / run_id)
            assert con.execute("SELECT count(*) FROM samples").fetchone()[0] == 5
        assert call(agent.port, "GET", "/readyz")[0] == 503  # a commit failed just now


def test_readiness_comes_back_once_commits_stop_failing(tmp_path):
    (tmp_path / "blocked").write_text("")
    with running_agent(tmp_path, nvml=False) as agent:
        agent.store.failure_window_s = 0.5
        assert call(agent.port, "GET", "/readyz")[0] == 200
        status, _ = call(agent.port, "POST", "/v1/trainspec/batches", _batch_body(0),
                         _batch_headers("blocked", "0"))  # fmt: skip
        assert status == 503
        assert call(agent.port, "GET", "/readyz")[0] == 503
        time.sleep(0.6)
        assert call(agent.port, "GET", "/readyz")[0] == 200  # not "any commit ever failed"
        assert agent.status()["store"]["commit_errors"] == 1


def test_a_run_whose_second_table_fails_keeps_none_of_that_cycle(tmp_path):
    """All or nothing within a run: the rank told 'failed' writes the whole batch itself."""
    import shutil

    import pyarrow as pa

    from trainspec.agent.writer import StoreWriter
    from trainspec.store.tables import STEPS

    def tables(step: int) -> dict[str, pa.Table]:
        step_row = {name: None for name in STEPS.names} | {"ts": 1.0, "rank": 0, "step": step}
        samples = decode_tables(_batch_body(0))["samples"]
        return {"samples": samples, "steps": pa.Table.from_pylist([step_row], schema=STEPS)}

    writer = StoreWriter(tmp_path, "n1", commit_interval_s=60, pending_rows=1000)
    first = writer.submit("run", tables(0)).cycle
    writer.commit()
    assert first.error is None
    steps_dir = tmp_path / "run" / "segments" / "steps" / writer.writer_id
    shutil.rmtree(steps_dir)
    steps_dir.write_text("")  # the steps segment of the next cycle cannot be written
    second = writer.submit("run", tables(1)).cycle
    writer.commit()
    assert second.done.is_set() and second.error
    samples = list((tmp_path / "run" / "segments" / "samples" / writer.writer_id).glob("seg-*"))
    assert len(samples) == 1  # the first cycle's; the second's samples segment was removed
    assert writer.rows_written == 6 and not writer.healthy()
    writer.close()


def test_a_ranks_event_counters_over_otlp_reach_metrics(agent, monkeypatch):
    """A rank's OTel sink exports its anomaly, action and fault counters with the rest; the
    agent took those for an unknown instrument and answered every such export with 500, so a
    run whose OTLP endpoint was the agent lost its points (found 2026-11-25)."""
    import time as _time

    import pyarrow as pa

    from trainspec.collector.records import Batch, EventRecord
    from trainspec.collector.sinks.otel import OTelSink

    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", f"http://127.0.0.1:{agent.port}")
    sink = OTelSink(
        {"service.name": "t", "trainspec.run.id": "events-run", "trainspec.rank": 0},
        export_interval_ms=60_000,
    )
    events = [
        EventRecord(ts=_time.time(), rank=0, step=3, kind=kind, name=name, reason="test")
        for kind, name in (("anomaly", "loss_spike"), ("action", "rebalance"), ("fault", "ecc"))
    ]
    try:
        sink.write(Batch(pa.Table.from_pylist([], schema=SAMPLES), [], events))
        sink.flush()
        assert sink.dropped == 0
    finally:
        sink.close()
    _, text = call(agent.port, "GET", "/metrics")
    for family in (
        "trainspec_anomalies_total",
        "trainspec_actions_total",
        "trainspec_faults_total",
    ):
        assert f"{family}{{".encode() in text, family


def _otlp_json_with_rank(rank: str | dict) -> bytes:
    now_ns = str(time.time_ns())
    point = {"asDouble": 0.5, "timeUnixNano": now_ns}
    value = rank if isinstance(rank, dict) else {"stringValue": rank}
    return json.dumps(
        {
            "resourceMetrics": [
                {
                    "resource": {
                        "attributes": [
                            {"key": "trainspec.rank", "value": value},
                            {"key": "trainspec.run.id", "value": {"stringValue": "big-rank"}},
                        ]
                    },
                    "scopeMetrics": [
                        {
                            "metrics": [
                                {
                                    "name": "trainspec.host.cpu.utilization",
                                    "gauge": {"dataPoints": [point]},
                                }
                            ]
                        }
                    ],
                }
            ]
        }  # fmt: skip
    ).encode()


@pytest.mark.parametrize("rank", ["3000000000", "2147483648", "-5000000000", "-3"])
def test_an_otlp_rank_outside_int32_is_refused_before_it_is_counted_or_forwarded(tmp_path, rank):
    """It was counted accepted, forwarded upstream, then answered 500 (ArrowInvalid). A
    negative rank is refused as the X-Trainspec-Rank header's is (-1 is the agent's "no
    rank")."""
    down = "http://127.0.0.1:9"  # nothing listens: a forwarded request would stay buffered
    with running_agent(tmp_path, upstream=down, nvml=False) as agent:
        headers = {"Content-Type": "application/json"}
        status, raw = call(agent.port, "POST", "/v1/metrics", _otlp_json_with_rank(rank), headers)
        counts = agent.counters.snapshot()
        fwd = agent.forwarder.stats()
    assert status == 400 and b"trainspec.rank" in raw, raw
    assert counts["rejected"] == {"otlp_rank": 1}
    assert "otlp" not in counts["accepted_requests"]
    assert fwd["buffered"] == 0 and fwd["dropped"] == 0


@pytest.mark.parametrize(
    "rank",
    [
        {"doubleValue": "Infinity"},  # int() raised OverflowError: a 500 with a traceback
        {"doubleValue": "-Infinity"},
        {"doubleValue": "NaN"},  # taken as no rank: 200
        {"doubleValue": 0.5},  # int() made it rank 0: 200
        {"boolValue": True},  # and this rank 1
        {"stringValue": "abc"},
        {"arrayValue": {"values": [{"intValue": "0"}]}},
    ],
)
def test_an_otlp_rank_that_is_no_whole_number_is_refused(tmp_path, rank):
    with running_agent(tmp_path, nvml=False) as agent:
        headers = {"Content-Type": "application/json"}
        status, raw = call(agent.port, "POST", "/v1/metrics", _otlp_json_with_rank(rank), headers)
        counts = agent.counters.snapshot()
        assert call(agent.port, "GET", "/healthz")[0] == 200  # and it keeps serving
    assert status == 400, raw
    assert b"trainspec.rank" in raw and b"not a whole number" in raw, raw
    assert b"Traceback" not in raw
    assert counts["rejected"] == {"otlp_rank": 1}


def test_an_otlp_rank_inside_int32_is_still_taken(tmp_path):
    with running_agent(tmp_path, nvml=False) as agent:
        headers = {"Content-Type": "application/json"}
        body = _otlp_json_with_rank(str(2**31 - 1))
        assert call(agent.port, "POST", "/v1/metrics", body, headers)[0] == 200
        for whole in ({"intValue": "3"}, {"doubleValue": 2.0}, {"stringValue": "4"}):
            body = _otlp_json_with_rank(whole)
            assert call(agent.port, "POST", "/v1/metrics", body, headers)[0] == 200, whole


def test_every_gzip_member_is_read():
    """Bytes after the first gzip member were dropped without a word (RFC 1952 allows many
    members, and gzip.decompress reads them all)."""
    from trainspec.agent.ingest import decompress

    body = gzip.compress(VALID[:100]) + gzip.compress(VALID[100:])
    assert decompress(body, "gzip", len(VALID)) == VALID
    assert decompress(gzip.compress(b""), "gzip", 10) == b""


@pytest.mark.parametrize(
    ("tail", "status"),
    [(b"junk after the member", 400), (b"\0\0\0\0", 400), (gzip.compress(b"x")[:-3], 400),
     (gzip.compress(b"y" * 64), 413)],  # a second member past the limit, the first under it
)  # fmt: skip
def test_data_after_a_gzip_member_that_is_no_whole_member_is_refused(tail, status):
    from trainspec.agent.ingest import Rejected, decompress

    assert decompress(gzip.compress(b"z" * 32), "gzip", 64) == b"z" * 32
    with pytest.raises(Rejected) as exc:
        decompress(gzip.compress(b"z" * 32) + tail, "gzip", 64)
    assert exc.value.status == status


def test_an_otlp_body_with_trailing_bytes_after_its_gzip_gets_400(agent):
    gz = {**PROTO, "Content-Encoding": "gzip"}
    before = _rejected(agent, "gzip")
    status, raw = call(agent.port, "POST", "/v1/metrics", gzip.compress(VALID) + b"trailer", gz)
    assert status == 400 and b"after gzip member 1" in raw, raw
    assert _rejected(agent, "gzip") == before + 1


@pytest.mark.timeout(60)
def test_a_commit_interval_longer_than_the_ranks_timeout_still_takes_their_batches(tmp_path):
    """With commit_interval_s above ~4.75 s (the sink's 5 s timeout less the margins) about
    half the batches were refused: 503 "commit did not start in time"."""
    with running_agent(tmp_path, commit_interval_s=30.0, nvml=False) as agent:
        for i in range(2):
            # A deadline well past the commit's lead, so a slow first commit on a loaded
            # machine still answers before it; the 30 s interval would not (503 before).
            headers = {**_batch_headers("slow-commit", "0"), "X-Trainspec-Batch": f"b-{i}",
                       "X-Trainspec-Deadline": f"{time.time() + 6.0:.3f}"}  # fmt: skip
            t0 = time.monotonic()
            status, raw = call(agent.port, "POST", "/v1/trainspec/batches", _batch_body(0), headers)
            assert status == 200, raw
            assert time.monotonic() - t0 < 6.0  # answered before the rank's deadline
        con = store.open(agent.settings.store + "/slow-commit")
        assert con.execute("SELECT count(*) FROM samples").fetchone()[0] == 10
