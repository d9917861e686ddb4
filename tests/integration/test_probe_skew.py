"""The latency probe reads the collective's latency: not the skew between ranks' sampler
threads (with one rank always launching 20 ms late, the other rank's own durations hold that
20 ms, and the readings, the smallest duration over the ranks carried in the next probe, do
not), and not less than a blocking all-reduce takes (the two-all-reduce probe before it read
the gap between two completions seen late by one thread: a median of 20 us where a blocking
all-reduce on the same group took 150-400 us)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.integration.jobs import torchrun

SCRIPT = Path(__file__).with_name("scripts") / "probe_skew.py"


@pytest.mark.timeout(120)
def test_a_late_rank_is_not_read_as_latency(tmp_path):
    proc = torchrun(tmp_path, "skew", script=SCRIPT, script_args=[], env={"SKEW_MS": "20"},
                    timeout_s=100)  # fmt: skip
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["aligned"] is True
    # Every probe is read out: the last ones by the carrier probe the shutdown alignment adds.
    assert result["readings"] == 40, result
    assert result["in_order"], result
    assert result["own_median_s"] > 0.015, result  # rank 0 waited for rank 1 in each probe
    assert result["reading_median_s"] < 0.010, result  # the latency, without the skew
    assert result["reading_median_s"] > 0.5 * result["round_trip_median_s"], result


@pytest.mark.timeout(120)
def test_a_tick_skipped_behind_a_late_peer_leaves_no_double_gap(tmp_path):
    """Every fourth tick of rank 1 comes 60 ms late (a loaded host): rank 0's next tick finds
    its probe still waiting and launches none. The probe is made up as soon as the late one
    completes, so rank 0 reads again within the interval; before, each such tick left a
    100 ms gap in its readings (10 in 40 probes), which fails the probe's cadence."""
    proc = torchrun(tmp_path, "late", script=SCRIPT, script_args=[],
                    env={"SKEW_MS": "5", "LATE_MS": "60", "LATE_EVERY": "4"},
                    timeout_s=100)  # fmt: skip
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["aligned"] is True and result["in_order"], result
    double = [gap for gap in result["gaps_s"] if gap > 0.09]
    assert len(double) <= 2, result  # 10 without the make-up; a loaded CI box may add one
    assert result["reading_median_s"] < 0.010, result  # the make-up's wait is not read
