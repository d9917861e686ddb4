"""Sidecar mode end to end: a 2-rank torchrun job sends to a real trainspec-agent process,
a real Prometheus server scrapes the agent, promtool lints its exposition."""

from __future__ import annotations

import json
import shutil
import subprocess
import time
import urllib.request

import pytest

import trainspec.store as store
from tests.integration.agent_process import start_agent, stop_agent
from tests.integration.jobs import free_port, torchrun
from tests.integration.test_collector_job import _prom_query, _prometheus
from trainspec.store.compliance import validate_target

pytestmark = pytest.mark.integration
PROMETHEUS = shutil.which("prometheus")
PROMTOOL = shutil.which("promtool")


def sidecar_env(port: int) -> dict[str, str]:
    return {
        "TRAINSPEC_COLLECTOR_MODE": "sidecar",
        "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{port}",  # how ranks find the agent
        "OTEL_METRIC_EXPORT_INTERVAL": "1000",
        "TRAINSPEC_STORE_FLUSH_INTERVAL_S": "0.5",
    }


@pytest.fixture(scope="module")
def sidecar_job(tmp_path_factory):
    if PROMETHEUS is None:
        pytest.skip("Debian's prometheus package is not installed")
    tmp = tmp_path_factory.mktemp("sidecar")
    port = free_port()
    agent = start_agent(tmp / "runs", port, log=tmp / "agent.log")
    prom, prom_port = _prometheus(tmp, [f"127.0.0.1:{port}"])
    try:
        torchrun(tmp / "runs", "side1", steps=40, env=sidecar_env(port))
        time.sleep(2.0)  # a last scrape round after the job
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
            exposition = r.read()
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/status", timeout=5) as r:
            status = json.loads(r.read())
        yield {"run": tmp / "runs" / "side1", "prom": prom_port, "metrics": exposition,
               "status": status, "log": tmp / "agent.log"}  # fmt: skip
    finally:
        prom.terminate()
        prom.wait(10)
        stop_agent(agent)


@pytest.mark.timeout(400)
def test_agent_is_the_only_writer_and_the_run_is_whole(sidecar_job):
    run = sidecar_job["run"]
    writers = {p.name for p in (run / "segments" / "steps").iterdir()}
    assert writers == {f"agent-{sidecar_job['status']['node']}"}  # no rank fell back
    con = store.open(run)
    steps = con.execute("SELECT rank, count(*) FROM steps GROUP BY rank ORDER BY rank").fetchall()
    assert steps == [(0, 40), (1, 40)]
    ranks = {r for (r,) in con.execute("SELECT DISTINCT rank FROM samples").fetchall()}
    assert ranks == {0, 1}  # no GPU here: the node adds no rows (host rows are the ranks')
    runs = con.execute("SELECT rank, world_size FROM runs ORDER BY rank").fetchall()
    assert runs == [(0, 2), (1, 2)]
    report = validate_target(str(run))
    # Cadence depends on this shared 2-core machine (agent, Prometheus and two ranks on it);
    # every other rule (presence per rank, units, ranges, runs rows) must hold.
    broken = [v for v in report.violations if v.rule != "cadence"]
    assert not broken, report.render_text()
    assert not report.warnings, report.warnings


@pytest.mark.timeout(400)
def test_real_prometheus_scraped_rank_and_node_series_from_the_agent(sidecar_job):
    port = sidecar_job["prom"]
    steps = _prom_query(port, "max_over_time(trainspec_step_duration_seconds_count[5m])")
    assert sorted(r["metric"]["trainspec_rank"] for r in steps) == ["0", "1"]
    assert all(float(r["value"][1]) > 0 for r in steps)
    node = _prom_query(
        port, 'max_over_time(trainspec_host_memory_used_bytes{service_name="trainspec-agent"}[5m])'
    )
    assert len(node) == 1 and float(node[0]["value"][1]) > 0
    info = _prom_query(port, "max_over_time(trainspec_agent_node_info[5m])")
    assert info and info[0]["metric"]["nvml"] == "unavailable"
    accepted = _prom_query(port, 'max_over_time(trainspec_agent_points_total{path="batch"}[5m])')
    scraped = float(accepted[0]["value"][1])
    # How many batches had arrived by Prometheus' last scrape depends on this machine's load;
    # what must hold: points were counted, and never more than the agent's own final count.
    final = _exposed_value(sidecar_job["metrics"], 'trainspec_agent_points_total{path="batch"}')
    assert 0 < scraped <= final


def _exposed_value(exposition: bytes, series: str) -> float:
    for line in exposition.decode().splitlines():
        if line.startswith(series + " "):
            return float(line.split()[-1])
    raise AssertionError(f"{series} is not in the agent's exposition")


@pytest.mark.timeout(120)
def test_promtool_lints_the_agent_exposition(sidecar_job):
    if PROMTOOL is None:
        pytest.skip("promtool is not installed")
    body = sidecar_job["metrics"]
    assert (
        b"trainspec_agent_rejected_requests_total" in body
        or b"trainspec_agent_requests_total" in body
    )
    result = subprocess.run([PROMTOOL, "check", "metrics"], input=body, capture_output=True,
                            timeout=60)  # fmt: skip
    assert result.returncode == 0, (result.stdout + result.stderr).decode()
    assert not (result.stdout + result.stderr).strip(), (result.stdout + result.stderr).decode()


@pytest.mark.timeout(120)
def test_nvml_unavailable_is_said_once(sidecar_job):
    text = sidecar_job["log"].read_text()
    assert text.count("NVML unavailable") == 1
    assert sidecar_job["status"]["inventory"]["nvml"] == "unavailable"


@pytest.mark.timeout(400)
def test_the_agents_exposition_carries_every_resource_attribute(sidecar_job, tmp_path):
    """The agent labelled a rank's series with run, rank and host only: `trainspec validate`
    on its /metrics reported service.name, local rank and world size missing (review)."""
    target = tmp_path / "agent.prom"
    target.write_bytes(sidecar_job["metrics"])
    report = validate_target(str(target))
    attrs = [v for v in report.violations if v.rule == "resource-attribute"]
    assert not attrs, report.render_text()
    text = sidecar_job["metrics"].decode()
    assert 'trainspec_world_size="2"' in text and 'trainspec_local_rank="1"' in text
    assert 'service_name="trainspec"' in text
