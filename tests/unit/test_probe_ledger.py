"""The probe ledger: the smallest duration over the ranks, read out of later probes' payloads,
each probe once and in order, with no probe blocked for ever by one that failed."""

from __future__ import annotations

import pytest

from trainspec.collector.samplers.probe_ledger import UNKNOWN, ProbeLedger


def close(got: list[tuple[float, float]], want: list[tuple[float, float]]) -> bool:
    """Readings equal to float precision (pytest.approx takes no nested structures from
    pytest 9.2 on)."""
    return len(got) == len(want) and all(
        g == pytest.approx(w) for g, w in zip(got, want, strict=True)
    )


def all_reduce_max(payloads: list[list[float]]) -> list[float]:
    return [max(column) for column in zip(*payloads, strict=True)]


def test_each_probe_reads_the_smallest_duration_over_the_ranks_once_in_order():
    ranks = [ProbeLedger(lags=4) for _ in range(3)]
    durations = {1: [0.030, 0.002, 0.010], 2: [0.004, 0.020, 0.003], 3: [0.005, 0.006, 0.007]}
    readings: list[list[tuple[float, float]]] = [[] for _ in ranks]
    for index in range(1, 5):
        result = all_reduce_max([r.launched(index, 100.0 + index) for r in ranks])
        for rank, ledger in enumerate(ranks):
            seconds = durations.get(index, [0.001] * 3)[rank]
            readings[rank] += ledger.finished(index, seconds, result)
    expected = [(101.0, 0.002), (102.0, 0.003), (103.0, 0.005)]  # probe 4 awaits a probe 5
    for got in readings:
        assert close(got, expected), got


def test_a_probe_one_rank_has_not_finished_is_read_out_of_a_later_probe():
    fast, slow = ProbeLedger(lags=4), ProbeLedger(lags=4)
    r1 = all_reduce_max([fast.launched(1, 1.0), slow.launched(1, 1.0)])
    assert fast.finished(1, 0.001, r1) == []
    # The slow rank launches probe 2 before its probe 1 completed: slot 1 is unknown there.
    r2 = all_reduce_max([fast.launched(2, 2.0), slow.launched(2, 2.0)])
    assert r2[0] == UNKNOWN
    assert slow.finished(1, 0.080, r1) == []
    assert fast.finished(2, 0.001, r2) == [] and slow.finished(2, 0.001, r2) == []
    r3 = all_reduce_max([fast.launched(3, 3.0), slow.launched(3, 3.0)])
    assert close(fast.finished(3, 0.001, r3), [(1.0, 0.001), (2.0, 0.001)])


def test_a_failed_probe_is_skipped_not_waited_for():
    a, b = ProbeLedger(lags=4), ProbeLedger(lags=4)
    r1 = all_reduce_max([a.launched(1, 1.0), b.launched(1, 1.0)])
    a.finished(1, 0.001, r1)
    b.finished(1, None, [UNKNOWN] * 4)  # timed out here: its duration is never known
    r2 = all_reduce_max([a.launched(2, 2.0), b.launched(2, 2.0)])
    a.finished(2, 0.002, r2)
    b.finished(2, 0.003, r2)
    r3 = all_reduce_max([a.launched(3, 3.0), b.launched(3, 3.0)])
    assert close(a.finished(3, 0.001, r3), [(2.0, 0.002)])


def test_only_the_window_is_kept():
    ledger = ProbeLedger(lags=3)
    for index in range(1, 50):
        payload = ledger.launched(index, float(index))
        ledger.finished(index, 0.001, payload)
    # the probes still running and the lags each of them reads out: 2 x lags
    assert len(ledger._stamps) <= 6 and len(ledger._seconds) <= 6
    with pytest.raises(ValueError, match="at least one lag"):
        ProbeLedger(lags=0)


def test_with_two_probes_in_flight_every_probe_is_read_out_on_every_rank():
    """A probe launched while the one before still ran dropped the stamp of the probe two
    before, which that one's completion then needed: its reading was lost (one rank of a
    demo stored 159 readings where the other stored 277, with gaps of seconds)."""
    lags = 2
    ranks = [ProbeLedger(lags=lags) for _ in range(2)]
    readings: list[list[tuple[float, float]]] = [[], []]
    results: dict[int, list[float]] = {}
    for index in range(1, 21):  # launch k + 1 before k completes, everywhere
        results[index] = all_reduce_max([r.launched(index, float(index)) for r in ranks])
        done = index - 1
        if done >= 1:
            for rank, ledger in enumerate(ranks):
                readings[rank] += ledger.finished(done, 0.001 * (rank + 1), results[done])
    for got in readings:
        assert [stamp for stamp, _ in got] == [float(i) for i in range(1, 18)]
        assert {value for _, value in got} == {0.001}
