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
