"""Latency spikes: the probe's window median against its own baseline; the tap that feeds it."""

from __future__ import annotations

import math

import pytest

from trainspec.actuator.latency_spike import LatencySpikeDetector
from trainspec.actuator.summary import RankSummary
from trainspec.collector.samplers.latency import METRIC
from trainspec.runtime.probe_latency import ProbeLatencyWindow


def window(*medians: float) -> list[RankSummary]:
    return [RankSummary(rank=r, probe_latency_s=m) for r, m in enumerate(medians)]


def test_a_spike_on_one_rank_is_named_once_and_cleared_once():
    d = LatencySpikeDetector(factor=3.0, floor_s=0.002, patience=1)
    for m in (0.0010, 0.0012, 0.0009, 0.0011):
        assert d.observe(window(m, m * 0.9)) == []
    (f,) = d.observe(window(0.0011, 0.009))  # rank 1: 9 ms against ~1 ms
    assert f.kind == "latency_spike" and f.ranks == (1,) and not f.cleared
    assert f.evidence["baseline_s"] == pytest.approx(0.00105)
    assert d.observe(window(0.001, 0.008)) == []  # still spiking: said once
    (back,) = d.observe(window(0.001, 0.0012))
    assert back.cleared and back.ranks == (1,)  # the rank the spike was found on
    assert d.observe(window(0.001, 0.0011)) == []


def test_a_spike_every_rank_reads_alike_names_no_single_rank():
    d = LatencySpikeDetector(factor=3.0, floor_s=0.002, patience=1)
    for m in (0.0010, 0.0012, 0.0009):
        d.observe(window(m, m, m))
    (f,) = d.observe(window(0.009, 0.009, 0.0088))  # the probe's one reading, on every rank
    assert f.ranks == (0, 1, 2) and "on every reporting rank" in f.reason
    assert f.evidence["rank"] is None and f.evidence["ranks"] == [0, 1, 2]
    d = LatencySpikeDetector(factor=3.0, floor_s=0.002, patience=1)
    for m in (0.0010, 0.0012, 0.0009):
        d.observe(window(m, m, m))
    (f,) = d.observe(window(0.009, 0.0011, 0.0092))
    assert f.ranks == (0, 2) and "on ranks 0, 2" in f.reason


def test_jitter_below_the_floor_and_missing_readings_are_not_spikes():
    d = LatencySpikeDetector(factor=3.0, floor_s=0.002, patience=1)
    for m in (0.0002, 0.0003, 0.0002):
        d.observe(window(m))
    assert d.observe(window(0.0015)) == []  # 6x, but only 1.3 ms above: under the floor
    assert d.observe(window(math.nan, math.nan)) == []  # no probe readings this window
    assert not d.active


def test_a_spike_does_not_raise_its_own_bar():
    d = LatencySpikeDetector(factor=3.0, floor_s=0.0, memory=4, min_baseline=2, patience=1)
    for m in (0.001, 0.001):
        d.observe(window(m))
    for _ in range(10):  # a long spike: the baseline stays 1 ms, so it never "clears"
        d.observe(window(0.01))
    assert d.active


def test_one_busy_window_is_not_a_spike_but_a_run_of_them_is():
    d = LatencySpikeDetector(factor=3.0, floor_s=0.002, patience=3)
    for m in (0.0002, 0.0002, 0.0002):
        d.observe(window(m, m))
    assert d.observe(window(0.0002, 0.005)) == []  # a host busy for one window
    assert d.observe(window(0.0002, 0.0002)) == []  # the run is broken
    found = [d.observe(window(0.0002, 0.006)) for _ in range(3)]
    assert [len(f) for f in found] == [0, 0, 1] and found[2][0].ranks == (1,)
    assert found[2][0].evidence["baseline_s"] == pytest.approx(0.0002)  # spikes left out


@pytest.mark.parametrize("factor, floor", [(1.0, 0.0), (3.0, -1.0), (math.nan, 0.0)])
def test_bad_settings_are_refused(factor, floor):
    with pytest.raises(ValueError, match="latency_spike"):
        LatencySpikeDetector(factor=factor, floor_s=floor)


def test_the_window_keeps_only_probe_readings_and_adds_an_injected_delay_when_told():
    k = [0.0]
    w = ProbeLatencyWindow(lambda: k[0])
    w.observe([(METRIC, 0.001, "{}"), ("trainspec.host.memory.used", 5e9, "{}")])
    w.observe([(METRIC, 0.003, "{}", 12.0), (METRIC, 0.002, "{}", 12.1)])
    assert w.take() == pytest.approx(0.002)
    assert math.isnan(w.take())  # taken: the next window starts empty
    k[0] = 0.02
    w.observe([(METRIC, 0.001, "{}")])
    assert w.take() == pytest.approx(0.021)


def test_the_window_keeps_the_newest_readings_only():
    w = ProbeLatencyWindow(capacity=4)
    w.observe([(METRIC, float(v), "{}") for v in range(10)])
    assert w.take() == pytest.approx(7.5)  # 6, 7, 8, 9


def test_a_window_the_controller_skips_is_emptied_not_carried_over():
    from tests.unit.test_actuator_controller import Peer, cfg, make, run_steps

    ctl, sampler, _hook, _events = make(cfg(window_steps=5), Peer())
    taken: list[int] = []
    ctl.latency_probe = lambda: taken.append(1) or math.nan
    run_steps(ctl, sampler, 5)
    assert len(taken) == 1  # the window closing at step 5
    ctl.paused = True
    run_steps(ctl, sampler, 10, start=5)
    assert len(taken) == 3  # paused windows (10, 15) still empty the readings
