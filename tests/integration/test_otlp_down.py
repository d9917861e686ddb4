"""An OTLP endpoint that nobody listens on costs the training loop nothing."""

from __future__ import annotations

import json
import statistics

import pytest

import trainspec.store as store
from tests.integration.jobs import free_port, torchrun


def _step_times(tmp_path, tag, env):
    timings = tmp_path / f"{tag}.json"
    torchrun(
        tmp_path, tag, env=env, script_args=["--steps=60", "--batch-size=8", f"--timings={timings}"]
    )
    return json.loads(timings.read_text())["step_times"][10:]


@pytest.mark.integration
@pytest.mark.timeout(400)
def test_unreachable_otlp_endpoint_drops_are_counted_and_training_unchanged(tmp_path):
    dead = f"http://127.0.0.1:{free_port()}"  # bound then released: nothing listens
    down = _step_times(
        tmp_path,
        "down",
        {"OTEL_EXPORTER_OTLP_ENDPOINT": dead, "OTEL_METRIC_EXPORT_INTERVAL": "300"},
    )
    base = _step_times(tmp_path, "base", {})
    con = store.open(tmp_path / "down")
    dropped = con.execute(
        "SELECT rank, max(value) FROM samples WHERE metric = 'trainspec.telemetry.dropped' GROUP BY rank ORDER BY rank"
    ).fetchall()
    assert len(dropped) == 2 and all(v > 0 for _, v in dropped), dropped
    ratio = statistics.median(down) / statistics.median(base)
    print(
        f"median step: endpoint down {statistics.median(down) * 1e3:.1f} ms, no OTel {statistics.median(base) * 1e3:.1f} ms, ratio {ratio:.3f}"
    )
    # A training thread that waited on the exporter would show multi-second steps (its timeout
    # is 10 s); the median bound is loose because this 2-core machine is shared.
    assert max(down) < 2.0
    assert ratio < 1.5
