"""The Streamlit app under AppTest on runs made by the reference workload (2-rank torchrun,
gloo), not on synthetic ones: every view renders what a real job wrote, the compliance view
gives the validator's verdict, and the compare view sets an actuator-off run beside an on run.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from streamlit.testing.v1 import AppTest

import trainspec.dashboards
from tests.integration.jobs import torchrun
from trainspec.dashboards.app import ROOT_ENV

pytestmark = pytest.mark.integration
APP = Path(trainspec.dashboards.__file__).with_name("app.py")
ARGS = ["--steps=60", "--batch-size=8", "--max-bytes=300000", "--layers=1", "--embd=64"]
SLOW = {"TRAINSPEC_INJECT": "slow:rank=1,factor=3", "TRAINSPEC_ALLOW_INJECT": "1",
        "TRAINSPEC_ACTUATOR_WINDOW_STEPS": "5"}  # fmt: skip


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("runs")
    torchrun(root, "ref-off", env={**SLOW, "TRAINSPEC_ACTUATOR": "off"}, script_args=ARGS,
             timeout_s=180)  # fmt: skip
    torchrun(root, "ref-on", env=SLOW, script_args=ARGS, timeout_s=180)
    return root


def _text(at: AppTest) -> str:
    parts = [e.value for kind in ("subheader", "warning", "info", "error", "success", "caption")
             for e in getattr(at, kind)]  # fmt: skip
    return "\n".join(str(p) for p in parts)


def _pick(at: AppTest, name: str) -> AppTest:
    picker = at.sidebar.selectbox(key="run")
    at = picker.select_index(next(i for i, o in enumerate(picker.options) if name in o)).run()
    assert not at.exception
    return at


@pytest.mark.timeout(420)
def test_every_view_renders_a_real_two_rank_run(monkeypatch, root):
    monkeypatch.setenv(ROOT_ENV, str(root))
    at = AppTest.from_file(str(APP), default_timeout=90).run()
    assert not at.exception
    at = _pick(at, "ref-off")
    metrics = {m.label: m.value for m in at.metric}
    assert metrics["ranks"] == "2 / 2", metrics
    assert "Overview" in _text(at)
    assert len(at.get("vega_lite_chart")) >= 6, "the overview drew too few charts"
    # With the actuator off the slowed rank stays slow per step, and the overview names it
    # (with it on, the rebalance evens per-step compute out, so there is nothing to flag).
    assert at.warning and "rank 1" in at.warning[0].value, _text(at)

    at = _pick(at, "ref-on")

    at = at.sidebar.radio(key="view").set_value("Compliance").run()
    assert not at.exception
    assert at.success and "COMPLIANT" in at.success[0].value, _text(at)

    at = at.sidebar.radio(key="view").set_value("Actions").run()
    assert not at.exception
    assert "Actions and anomalies" in _text(at)
    labels = " | ".join(e.label for e in at.expander)  # one per decision, with its reason
    assert "straggler" in labels and "rebalance" in labels, labels

    at = at.sidebar.radio(key="view").set_value("Compare").run()
    assert not at.exception
    assert "Compare runs" in _text(at) and "ref-off" in _text(at), _text(at)

    at = at.sidebar.radio(key="view").set_value("Hardware").run()
    assert not at.exception
    assert "no GPUs in this run" in _text(at)  # a CPU run says so instead of empty panels
