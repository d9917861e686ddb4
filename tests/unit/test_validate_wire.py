"""`trainspec validate` on Prometheus expositions and OTLP payloads (protobuf and JSON)."""

from __future__ import annotations

import math
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from tests.helpers.payloads import (
    otlp_json,
    otlp_request,
    prometheus_exposition,
    write_single_export,
)
from tests.helpers.runs import break_run, synthetic_run
from trainspec.cli.main import main
from trainspec.schema.targets import TargetError, decode_otlp
from trainspec.schema.targets.prometheus_text import fetch
from trainspec.store.compliance import validate_target

STEP = "trainspec.step.duration"


def _rules(report) -> set[tuple[str, int | None, str]]:
    return {(v.metric, v.rank, v.rule) for v in report.violations}


def _files(tmp_path, run, **kw):
    """The same run as a Prometheus text file, an OTLP protobuf and an OTLP/JSON file."""
    rename = kw.pop("rename", None)
    prom = tmp_path / "metrics.prom"
    prom.write_bytes(prometheus_exposition(run, rename=rename))
    request = otlp_request(run, **kw)
    pb = tmp_path / "payload.pb"
    pb.write_bytes(request.SerializeToString())
    js = tmp_path / "payload.json"
    js.write_bytes(otlp_json(request))
    return prom, pb, js


@pytest.mark.parametrize("gpus", [False, True])
def test_compliant_exposition_and_payloads_pass(tmp_path, capsys, gpus):
    for target in _files(tmp_path, synthetic_run(2, 1.0, gpus)):
        assert main(["validate", str(target)]) == 0, capsys.readouterr().out
    report = validate_target(str(tmp_path / "metrics.prom"))
    assert "cadence not judged" in report.notes[0] and not report.warnings


def test_missing_rank_in_every_wire_format(tmp_path):
    run = break_run(synthetic_run(3, 1.0, False), drop_rank=2)
    for target in _files(tmp_path, run):
        assert ("*", 2, "rank-present") in _rules(validate_target(str(target))), target


def test_an_exposition_without_resource_labels_or_with_a_bad_rank_fails(tmp_path):
    """Prometheus series were never checked for the resource attributes (OTLP resources
    were), and a rank of "abc" or -3 was accepted: all three files were COMPLIANT."""
    import re

    text = prometheus_exposition(synthetic_run(1, 1.0, False)).decode()
    cases = {
        "bare": re.sub(r'(service_name|host_name|trainspec_run_id)="[^"]*",?', "", text),
        "abc": text.replace('trainspec_rank="0"', 'trainspec_rank="abc"'),
        "negative": text.replace('trainspec_rank="0"', 'trainspec_rank="-3"'),
    }
    assert all(case != text for case in cases.values())
    found = {}
    for name, body in cases.items():
        target = tmp_path / f"{name}.prom"
        target.write_text(body.replace(",}", "}"))
        report = validate_target(str(target))
        found[name] = {v.evidence for v in report.violations if v.rule == "resource-attribute"}
    assert found["bare"] == {
        "resource lacks service.name", "resource lacks host.name", "resource lacks trainspec.run.id"
    }  # fmt: skip
    assert found["abc"] == {"trainspec.rank is 'abc', not an integer in plain decimal digits"}
    assert found["negative"] == {"trainspec.rank is '-3', below 0 (a rank counts from 0)"}


def test_an_array_or_key_value_resource_attribute_is_judged_not_a_crash(tmp_path):
    """OTLP decodes arrayValue and kvlistValue attributes to lists and dicts: looking the
    resource up in a set raised "unhashable type: 'list'" (review)."""
    import json

    request = otlp_request(synthetic_run(1, 1.0, False))
    body = json.loads(otlp_json(request))
    for rm in body["resourceMetrics"]:
        rm["resource"]["attributes"] += [
            {"key": "os.tags", "value": {"arrayValue": {"values": [{"stringValue": "a"}]}}},
            {"key": "k8s.labels", "value": {"kvlistValue": {"values": [
                {"key": "app", "value": {"stringValue": "x"}}]}}},
        ]  # fmt: skip
        for attr in rm["resource"]["attributes"]:
            if attr["key"] == "host.name":
                attr["value"] = {"arrayValue": {"values": [{"stringValue": "h"}]}}
    target = tmp_path / "payload.json"
    target.write_text(json.dumps(body))
    report = validate_target(str(target))
    assert not [v for v in report.violations if v.rule == "resource-attribute"]


def test_wrong_unit(tmp_path):
    prom, pb, js = _files(
        tmp_path,
        synthetic_run(1, 1.0, False),
        rename={STEP: "trainspec_step_duration_milliseconds"},
        units={STEP: "ms"},
    )
    for target in (prom, pb, js):
        (v,) = validate_target(str(target)).violations
        assert (v.metric, v.rule) == (STEP, "unit") and "'ms'" in v.evidence


@pytest.mark.parametrize("kind", ["counter", "untyped"])
def test_wrong_instrument_in_prometheus(tmp_path, kind):
    text = prometheus_exposition(synthetic_run(1, 1.0, False)).decode()
    text = text.replace(
        "# TYPE trainspec_host_memory_used_bytes gauge",
        f"# TYPE trainspec_host_memory_used_bytes {kind}",
    )
    (tmp_path / "m.prom").write_text(text)
    report = validate_target(str(tmp_path / "m.prom"))
    assert ("trainspec.host.memory.used", None, "instrument") in _rules(report)
    (v,) = [v for v in report.violations if v.rule == "instrument"]
    said = "an untyped metric" if kind == "untyped" else "a counter"  # "a untyped" (QA)
    assert f"trainspec_host_memory_used_bytes is {said}, the catalogue says" in v.evidence


def test_otlp_cadence_is_judged_on_real_gaps(tmp_path):
    metric = "trainspec.host.cpu.utilization"
    run = break_run(synthetic_run(1, 2.0, False), slow_metric=metric, slow_period_s=0.5)
    _, pb, js = _files(tmp_path, run)
    for target in (pb, js):
        assert _rules(validate_target(str(target))) == {(metric, 0, "cadence")}


def test_nan_and_counter_down(tmp_path):
    run = break_run(
        synthetic_run(1, 2.0, False),
        nan_metric="trainspec.process.memory.rss",
        counter_down="trainspec.telemetry.dropped",
    )
    prom, pb, js = _files(tmp_path, run)
    for target in (pb, js):
        assert _rules(validate_target(str(target))) == {
            ("trainspec.process.memory.rss", 0, "finite"),
            ("trainspec.telemetry.dropped", 0, "monotonic"),
        }
    # A scrape is one snapshot: only the last value of each series is there to judge.
    text = prom.read_text().replace(
        [ln for ln in prom.read_text().splitlines() if ln.startswith("trainspec_memory_pressure")][
            0
        ].rsplit(" ", 1)[1],
        "NaN",
    )
    prom.write_text(text)
    assert ("trainspec.memory.pressure", 0, "finite") in _rules(validate_target(str(prom)))


def test_missing_required_attribute_and_resource_attribute(tmp_path):
    run = synthetic_run(1, 1.0, True)
    for r in run.samples:
        if r["metric"] == "trainspec.gpu.temperature":
            r["attrs"] = '{"gpu.index": 0}'
    request = otlp_request(run)
    request.resource_metrics[0].resource.attributes.pop()  # trainspec.world_size
    (tmp_path / "p.pb").write_bytes(request.SerializeToString())
    rules = _rules(validate_target(str(tmp_path / "p.pb")))
    assert ("trainspec.gpu.temperature", 0, "attribute") in rules
    assert ("*", 0, "resource-attribute") in rules


def test_decode_otlp_normalizes_points():
    request = otlp_request(synthetic_run(2, 0.5, False))
    for body, ctype in (
        (request.SerializeToString(), "application/x-protobuf"),
        (otlp_json(request), "application/json; charset=utf-8"),
    ):
        points = decode_otlp(body, ctype)
        ranks = {p.rank for p in points}
        assert ranks == {0, 1}
        hist = next(p for p in points if p.name == STEP)
        assert hist.kind == "histogram" and hist.count == 1 and math.isclose(hist.sum, 0.09)
        counter = next(p for p in points if p.name == "trainspec.step.samples")
        assert counter.instrument == "counter" and counter.cumulative and counter.value == 32
        gauge = next(p for p in points if p.name == "trainspec.memory.pressure")
        assert gauge.kind == "gauge" and gauge.ts and gauge.resource["service.name"] == "synthetic"


@pytest.mark.parametrize(
    ("body", "ctype"),
    [
        (b"\xff\xfe garbage \x00\x01", "application/x-protobuf"),
        (b"{not json", "application/json"),
        (b"{}", "application/json"),
        (b"", "application/x-protobuf"),
    ],
)
def test_decode_otlp_refuses_what_is_not_a_payload(body, ctype):
    with pytest.raises(TargetError) as exc:
        decode_otlp(body, ctype)
    assert "\n" not in str(exc.value)


_DEEP = 100_000
DEEP_JSON = {
    "objects": b'{"a":' * _DEEP,
    "arrays": b'{"resourceMetrics":' + b"[" * _DEEP + b"]" * _DEEP + b"}",
    # shallow enough for json, deep enough for the exemplar walk and ParseDict
    "under-json-limit": b'{"resourceMetrics":' + b'[{"a":' * 400 + b"1" + b"}]" * 400 + b"}",
}


@pytest.mark.parametrize("case", sorted(DEEP_JSON))
def test_deeply_nested_json_exits_2(tmp_path, capsys, case):
    target = tmp_path / "deep.json"
    target.write_bytes(DEEP_JSON[case])
    assert main(["validate", str(target)]) == 2
    err = capsys.readouterr().err.strip()
    assert (
        err
        == f"trainspec validate: error: {target}: not an OTLP/JSON metrics request: nested too deeply"
    )


@pytest.mark.parametrize("name", ["garbage.pb", "garbage.prom", "garbage", "garbage.json"])
def test_garbage_files_exit_2(tmp_path, capsys, name):
    (tmp_path / name).write_bytes(b"\x08\x96\x01\xff\xff garbage {{{ \x00" * 10)
    assert main(["validate", str(tmp_path / name)]) == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1


@pytest.mark.parametrize(
    ("doc", "kind"), [(b"null", "NoneType"), (b"5", "int"), (b"true", "bool"), (b'"x"', "str")]
)
def test_a_json_payload_that_is_not_an_object_exits_2(tmp_path, capsys, doc, kind):
    target = tmp_path / "p.json"
    target.write_bytes(doc)
    assert main(["validate", str(target)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (
        f"trainspec validate: error: {target}: not an OTLP/JSON metrics request: "
        f"the document is a JSON {kind}, not an object"
    )


def test_prometheus_over_http(tmp_path, capsys):
    body = prometheus_exposition(synthetic_run(1, 1.0, False))

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 (http.server's name)
            self.send_response(200 if self.path == "/metrics" else 404)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.end_headers()
            self.wfile.write(body if self.path == "/metrics" else b"")

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{server.server_port}"
        assert main(["validate", f"{url}/metrics"]) == 0
        assert main(["validate", f"{url}/nothing"]) == 2
        assert "404" in capsys.readouterr().err
    finally:
        server.shutdown()
        server.server_close()


def test_a_single_export_warns_that_cadence_was_not_judged(tmp_path):
    report = validate_target(str(write_single_export(tmp_path / "one.pb")))
    assert report.compliant
    assert report.notes == ["cadence not judged: no series holds two timed points"]
    assert not report.warnings


def _raw_server(answer):
    """A TCP server that reads the request and calls answer(socket) on its own thread."""
    listener = socket.create_server(("127.0.0.1", 0))

    def loop():
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            conn.recv(65536)
            threading.Thread(target=answer, args=(conn,), daemon=True).start()

    threading.Thread(target=loop, daemon=True).start()
    return listener, f"http://127.0.0.1:{listener.getsockname()[1]}/metrics"


def _reply(raw: bytes):
    def answer(conn):
        with conn:
            conn.sendall(raw)

    return answer


@pytest.mark.parametrize(
    ("raw", "reason"),
    [
        (b"hello there\r\n\r\n", "hello there"),  # not HTTP at all
        (b"HTTP/1.1 200 OK\r\nContent-Length: 999\r\n\r\ntrainspec_x 1\n", "IncompleteRead"),
        (b"HTTP/1.1 200 OK\r\nContent-Type: text/html\r\n\r\n<html><h1>Hi</h1></html>\n", "not a Prometheus"),
    ],
)  # fmt: skip
def test_endpoints_that_answer_badly_exit_2_naming_the_url(capsys, raw, reason):
    listener, url = _raw_server(_reply(raw))
    try:
        assert main(["validate", url]) == 2
    finally:
        listener.close()
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and url in err and reason in err, err


def test_a_malformed_url_exits_2(capsys):
    assert main(["validate", "http://[::1/metrics"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "cannot fetch" in err


def test_an_endpoint_that_trickles_is_given_up_on_in_time():
    def trickle(conn):  # headers, then one byte a little faster than the socket timeout
        with conn:
            try:
                conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\n\r\n")
                for _ in range(60):
                    conn.sendall(b"#")
                    time.sleep(0.2)
            except OSError:
                return

    listener, url = _raw_server(trickle)
    started = time.monotonic()
    try:
        with pytest.raises(TargetError, match="no complete answer"):
            fetch(url, timeout_s=1.0)
    finally:
        listener.close()
    assert time.monotonic() - started < 3.0


def test_the_agents_own_metrics_are_left_unjudged_not_unknown(tmp_path, capsys):
    """A node agent's /metrics serves the ranks' series beside its own request and row
    counts (trainspec_agent_*): the standard names those a component's own namespace."""
    text = prometheus_exposition(synthetic_run(2, 1.0, False)).decode()
    text += (
        "# HELP trainspec_agent_requests_total Requests received.\n"
        "# TYPE trainspec_agent_requests_total counter\n"
        'trainspec_agent_requests_total{route="/v1/metrics"} 12\n'
        "# HELP trainspec_bogus_seconds Not in the catalogue.\n"
        "# TYPE trainspec_bogus_seconds gauge\n"
        "trainspec_bogus_seconds 1\n"
    )
    target = tmp_path / "agent.prom"
    target.write_text(text)
    report = validate_target(str(target))
    assert {v.rule for v in report.violations} == {"name"}  # only the bogus name
    assert report.violations[0].metric == "trainspec_bogus_seconds"
    assert any("not judged: 1 metric(s) of a component's own" in n for n in report.notes)
    target.write_text(text.split("# HELP trainspec_bogus_seconds")[0])
    assert main(["validate", str(target)]) == 0, capsys.readouterr().out


_HIST = "# TYPE trainspec_step_duration_seconds histogram\ntrainspec_step_duration_seconds_"
BAD_HISTOGRAMS = {
    "le-not-a-number": _HIST + 'bucket{le="abc"} 1\n' + _HIST + "count 1\n",
    "le-nan": _HIST + 'bucket{le="NaN"} 1\n' + _HIST + "count 1\n",
    "count-nan": _HIST + 'bucket{le="+Inf"} 1\n' + _HIST + "count NaN\n" + _HIST + "sum 1\n",
    "count-inf": _HIST + 'bucket{le="+Inf"} 1\n' + _HIST + "count +Inf\n" + _HIST + "sum 1\n",
    "bucket-nan": _HIST + 'bucket{le="+Inf"} NaN\n' + _HIST + "count 1\n" + _HIST + "sum 1\n",
    # Passed as compliant until 2026-11-27: a bucket above the next, an +Inf bucket that is
    # not the count, and no +Inf bucket.
    "buckets-fall": _HIST
    + 'bucket{le="0.1"} 5\n'
    + _HIST
    + 'bucket{le="+Inf"} 4\n'
    + _HIST
    + "count 4\n"
    + _HIST
    + "sum 1\n",
    "inf-not-count": _HIST
    + 'bucket{le="0.1"} 1\n'
    + _HIST
    + 'bucket{le="+Inf"} 3\n'
    + _HIST
    + "count 4\n"
    + _HIST
    + "sum 1\n",
    "no-inf": _HIST + 'bucket{le="0.1"} 1\n' + _HIST + "count 1\n" + _HIST + "sum 1\n",
}


@pytest.mark.parametrize("case", sorted(BAD_HISTOGRAMS))
def test_malformed_histogram_exits_2_naming_the_sample(tmp_path, capsys, case):
    """As the OpenMetrics parser refuses them: a bound that is no number, a count that is none."""
    target = tmp_path / f"{case}.prom"
    target.write_text(BAD_HISTOGRAMS[case])
    assert main(["validate", str(target)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "trainspec_step_duration_seconds_" in err, err
    assert "not a Prometheus exposition" in err, err


@pytest.mark.parametrize("text", ["# HELP x,y help\n", "# TYPE x,y counter\nx 1\n"])
def test_an_exposition_the_parser_refuses_without_a_message_is_named(tmp_path, capsys, text):
    """prometheus_client raises a bare ValueError() on these: the message's first line was
    an IndexError, reported as an unexpected error."""
    target = tmp_path / "bad.prom"
    target.write_text(text)
    assert main(["validate", str(target)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "not a Prometheus exposition: line 1: " in err, err
    assert f"{text.splitlines()[0]!r}: ValueError" in err, err  # the line refused, named


def test_malformed_histogram_over_http_exits_2(capsys):
    body = BAD_HISTOGRAMS["count-nan"].encode()
    head = f"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: {len(body)}\r\n\r\n"
    listener, url = _raw_server(_reply(head.encode() + body))
    try:
        assert main(["validate", url]) == 2
    finally:
        listener.close()
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and url in err and "_count is nan" in err, err


def test_a_nan_histogram_sum_is_a_finite_violation(tmp_path):
    target = tmp_path / "sum-nan.prom"
    once = _HIST.split("\n")[1]  # one TYPE line: a second is refused as promtool does
    target.write_text(_HIST + 'bucket{le="+Inf"} 1\n' + once + "count 1\n" + once + "sum NaN\n")
    assert (STEP, None, "finite") in _rules(validate_target(str(target)))


COUNTER = "trainspec.telemetry.dropped"


def test_a_series_repeated_with_another_value_is_a_duplicate(tmp_path):
    """A counter line written twice in one exposition (10 then 3), or two points of a counter
    at one time in a payload: each series has one value at a time, and the drop from 10 to 3
    counts. Sorting by (time, value) had put 3 first, and the verdict was COMPLIANT."""
    run = synthetic_run(1, 1.0, False)
    prom, pb, _ = _files(tmp_path, run)
    lines = prom.read_text().splitlines()
    line = next(x for x in lines if x.startswith("trainspec_telemetry_dropped_total{"))
    series = line.rsplit(" ", 1)[0]
    prom.write_text("\n".join([*lines, f"{series} 10.0", f"{series} 3.0"]) + "\n")
    assert (COUNTER, 0, "duplicate") in _rules(validate_target(str(prom)))

    request = otlp_request(run)
    for metric in request.resource_metrics[0].scope_metrics[0].metrics:
        if metric.name == COUNTER:
            points = metric.sum.data_points
            last = points[-1]
            for value in (last.as_double + 10.0, last.as_double + 3.0):
                extra = points.add()
                extra.CopyFrom(last)
                extra.as_double = value
    pb.write_bytes(request.SerializeToString())
    rules = _rules(validate_target(str(pb)))
    assert {(COUNTER, 0, "duplicate"), (COUNTER, 0, "monotonic")} <= rules


def test_an_exact_repeat_is_not_a_duplicate(tmp_path):
    prom, _, _ = _files(tmp_path, synthetic_run(1, 1.0, False))
    lines = prom.read_text().splitlines()
    line = next(x for x in lines if x.startswith("trainspec_telemetry_dropped_total{"))
    prom.write_text("\n".join([*lines, line]) + "\n")
    assert not any(rule == "duplicate" for _, _, rule in _rules(validate_target(str(prom))))


def _with_label(prom: bytes, label: str, value: str) -> bytes:
    import re

    return re.sub(rf'{label}="\d+"'.encode(), f'{label}="{value}"'.encode(), prom)


@pytest.mark.parametrize(
    ("label", "value", "words"),
    [
        ("trainspec_world_size", "200000000", "world size 200000000 is not plausible"),
        ("trainspec_rank", "300000000", "rank 300000000 is not plausible"),
    ],
)
def test_an_implausible_world_is_refused_in_one_line(tmp_path, capsys, label, value, words):
    """It built a rank table of that size: 24 GB and killed, or still running after 60 s."""
    prom = tmp_path / "m.prom"
    prom.write_bytes(_with_label(prometheus_exposition(synthetic_run(2, 1.0, False)), label, value))
    assert main(["validate", str(prom)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and words in err


def test_many_absent_ranks_are_listed_up_to_a_limit_then_counted(tmp_path):
    from trainspec.schema.validate import ABSENT_LISTED

    prom = tmp_path / "m.prom"
    exposition = prometheus_exposition(synthetic_run(2, 1.0, False))
    prom.write_bytes(_with_label(exposition, "trainspec_world_size", "1000"))
    absent = [v for v in validate_target(str(prom)).violations if v.rule == "rank-present"]
    assert [v.rank for v in absent[:ABSENT_LISTED]] == list(range(2, 2 + ABSENT_LISTED))
    assert len(absent) == ABSENT_LISTED + 1
    assert absent[-1].rank is None
    assert absent[-1].evidence.startswith(
        f"{998 - ABSENT_LISTED} more ranks ({2 + ABSENT_LISTED} to 999)"
    )


def test_a_body_over_the_limit_is_refused_not_parsed(tmp_path, monkeypatch):
    import trainspec.schema.targets.prometheus_text as prometheus_text

    monkeypatch.setattr(prometheus_text, "MAX_BODY_BYTES", 2 << 20)
    body = prometheus_exposition(synthetic_run(1, 1.0, False))
    big = body * ((3 << 20) // len(body) + 1)
    (tmp_path / "big.prom").write_bytes(big)
    with pytest.raises(TargetError, match="larger than 2 MiB"):
        validate_target(str(tmp_path / "big.prom"))

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 (http.server's name)
            self.send_response(200)
            self.end_headers()
            self.wfile.write(big)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        with pytest.raises(TargetError, match="body is larger than 2 MiB"):
            fetch(f"http://127.0.0.1:{server.server_port}/metrics")
    finally:
        server.shutdown()
        server.server_close()
