"""An exposition of every catalogue metric passes `promtool check metrics` and `validate`."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from tests.helpers.payloads import prometheus_exposition
from tests.helpers.runs import synthetic_run
from trainspec.schema import load_catalogue
from trainspec.store.compliance import validate_target

PROMTOOL = shutil.which("promtool")
pytestmark = pytest.mark.skipif(PROMTOOL is None, reason="promtool is not installed")


def _check(body: bytes) -> subprocess.CompletedProcess:
    return subprocess.run(
        [PROMTOOL, "check", "metrics"], input=body, capture_output=True, timeout=60
    )


@pytest.mark.timeout(120)
def test_every_catalogue_metric_passes_promtool(tmp_path):
    body = prometheus_exposition(synthetic_run(2, 1.0, True), every_metric=True)
    text = body.decode()
    for metric in load_catalogue():
        assert f"# TYPE {metric.prometheus_name.removesuffix('_total')}" in text, metric.name
        for attr in metric.required_attributes:
            assert f'{attr.replace(".", "_")}="' in text
    result = _check(body)
    assert result.returncode == 0, (result.stdout + result.stderr).decode()
    assert not (result.stdout + result.stderr).strip(), "promtool reported lint problems"
    (tmp_path / "all.prom").write_bytes(body)
    report = validate_target(str(tmp_path / "all.prom"))
    assert report.compliant, report.render_text()


@pytest.mark.timeout(120)
def test_promtool_catches_a_name_without_its_unit_suffix():
    # The check is real: a counter not ending in _total is linted.
    body = b"# HELP trainspec_x_bytes x\n# TYPE trainspec_x_bytes counter\ntrainspec_x_bytes 1\n"
    result = _check(body)
    assert b"_total" in result.stdout + result.stderr
