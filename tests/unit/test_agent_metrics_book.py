"""The agent's /metrics stays bounded and never holds up a rank's answer.

Found 2026-11-27 (QA bigbatch.py: one batch of 200,000 distinct attribute sets): the answer
waited 22 s on the /metrics aggregation (the ranks wait 5 s, then write the batch
themselves), every later scrape took 6-7 s for 25 MiB, and series never expired."""

from __future__ import annotations

import json
import logging
import time

import pyarrow as pa
from prometheus_client.parser import text_string_to_metric_families

from tests.unit.agent_fixtures import call, running_agent
from trainspec.collector.records import Batch, StepRecord
from trainspec.collector.sinks.agent import BATCH_CONTENT_TYPE, batch_tables, encode_tables
from trainspec.store.tables import SAMPLES


def _body(rank: int, metric: str, attrs: list[dict], steps: int = 0) -> bytes:
    rows = [{"ts": time.time(), "rank": rank, "metric": metric, "value": 1.0 + i,
             "attrs": json.dumps(a)} for i, a in enumerate(attrs)]  # fmt: skip
    step_rows = [StepRecord(ts=time.time(), rank=rank, step=i, duration_s=0.1, samples=8)
                 for i in range(steps)]  # fmt: skip
    batch = Batch(pa.Table.from_pylist(rows, schema=SAMPLES), step_rows, [])
    return encode_tables(batch_tables(batch))


def _post(port: int, body: bytes, run_id: str = "book", rank: int = 0) -> tuple[int, float]:
    headers = {"Content-Type": BATCH_CONTENT_TYPE, "X-Trainspec-Run-Id": run_id,
               "X-Trainspec-Rank": str(rank),
               "X-Trainspec-Deadline": f"{time.time() + 5:.3f}"}  # fmt: skip
    start = time.monotonic()
    status, raw = call(port, "POST", "/v1/trainspec/batches", body, headers)
    assert status == 200, raw
    return status, time.monotonic() - start


def _scrape(port: int) -> dict[str, list[tuple[dict[str, str], float]]]:
    _, text = call(port, "GET", "/metrics")
    out: dict[str, list] = {}
    for fam in text_string_to_metric_families(text.decode()):
        for s in fam.samples:
            out.setdefault(s.name, []).append((s.labels, s.value))
    return out


def _value(scrape: dict, name: str) -> float:
    return scrape[name][0][1]


def test_the_series_count_is_capped_counted_and_said_once(tmp_path, caplog):
    many = [{"gpu.index": 0, "k": f"v{i}"} for i in range(500)]
    with (
        caplog.at_level(logging.WARNING, logger="trainspec.agent"),
        running_agent(tmp_path, nvml=False, metrics_max_series=100) as agent,
    ):
        _post(agent.port, _body(0, "trainspec.gpu.power", many))
        _post(agent.port, _body(0, "trainspec.gpu.power", many))
        scrape = _scrape(agent.port)
    assert len(scrape["trainspec_gpu_power_watts"]) <= 100
    assert _value(scrape, "trainspec_agent_series") == 100
    assert _value(scrape, "trainspec_agent_series_dropped_points_total") >= 800
    said = [r.getMessage() for r in caplog.records if "metrics_max_series" in r.getMessage()]
    assert len(said) == 1, said


def test_series_not_updated_expire_gauges_first_counters_with_their_source(tmp_path):
    with running_agent(tmp_path, nvml=False, metrics_series_ttl_s=1.0) as agent:
        _post(agent.port, _body(0, "trainspec.gpu.power", [{"gpu.index": 0}], steps=2))
        _post(agent.port, _body(1, "trainspec.gpu.power", [{"gpu.index": 1}]), rank=1)
        first = _scrape(agent.port)
        assert len(first["trainspec_gpu_power_watts"]) == 2
        assert first["trainspec_step_samples_total"][0][1] == 16
        time.sleep(0.7)
        # Rank 0 goes on sending, without its GPU reading now: that gauge goes, its counter
        # (a running count that would restart at 0) stays; rank 1 goes quiet: all of it goes.
        _post(agent.port, _body(0, "trainspec.host.memory.used", [{}]))
        time.sleep(0.7)
        _post(agent.port, _body(0, "trainspec.host.memory.used", [{}]))
        second = _scrape(agent.port)
    assert "trainspec_gpu_power_watts" not in second, second.get("trainspec_gpu_power_watts")
    assert [lab["trainspec_rank"] for lab, _ in second["trainspec_step_samples_total"]] == ["0"]
    assert _value(second, "trainspec_agent_series_expired_total") >= 2
    ranks = {lab.get("trainspec_rank") for samples in second.values() for lab, _ in samples}
    assert "1" not in ranks


def test_the_answer_does_not_wait_for_metrics_and_a_later_scrape_sees_the_batch(
    tmp_path, monkeypatch
):
    with running_agent(tmp_path, nvml=False) as agent:
        feed = agent._feed_book

        def slow_feed(*args):  # as 200,000 distinct series took 22 s
            time.sleep(3.0)
            feed(*args)

        monkeypatch.setattr(agent, "_feed_book", slow_feed)
        _, took = _post(agent.port, _body(0, "trainspec.gpu.power", [{"gpu.index": 3}]))
        assert took < 2.0, took
        scrape = _scrape(agent.port)  # waits for what was answered before it
        assert [lab["gpu_index"] for lab, _ in scrape["trainspec_gpu_power_watts"]] == ["3"]


def test_the_books_series_keys_are_the_aggregation_tables_own():
    """Expiry forgets series by the key PrometheusState files them under: were the two to
    differ, a series would never expire and the count would drift from the cap."""
    from trainspec.agent.exposition import SeriesBook
    from trainspec.schema import load_catalogue

    book = SeriesBook(load_catalogue(), max_series=1000, ttl_s=0.01)
    attrs = [{"gpu.index": 0}, {"gpu.index": 1, "hw.id": ""}, {"gpu.index": 2, "k": "v"}, {}]
    rows = [{"ts": time.time(), "rank": 0, "metric": "trainspec.gpu.power", "value": 1.0,
             "attrs": json.dumps(a)} for a in attrs]  # fmt: skip
    steps = [StepRecord(ts=time.time(), rank=0, step=0, duration_s=0.1, samples=8)]
    book.apply_batch(("r", 0), {"trainspec.rank": 0},
                     Batch(pa.Table.from_pylist(rows, schema=SAMPLES), steps, []))  # fmt: skip
    state = book.state(("r", 0), {})
    assert set(state._touched) == state.series_keys()
    assert book.budget.series == len(state.series_keys()) > 0
    time.sleep(0.05)
    book.expire()
    assert state.series_keys() == set() and book.budget.series == 0
    assert book.sources() == []


def test_a_batch_for_a_source_retired_meanwhile_goes_to_a_fresh_one():
    """The feed thread looks a source's state up, then applies to it; an expiry between the
    two took the state off the book: the batch's series counted against the cap for ever and
    were never shown. A retired state takes nothing, and the batch goes to a fresh one."""
    from trainspec.agent.exposition import SeriesBook
    from trainspec.schema import load_catalogue

    book = SeriesBook(load_catalogue(), max_series=1000, ttl_s=0.01)
    rows = [{"ts": time.time(), "rank": 0, "metric": "trainspec.gpu.power", "value": 1.0,
             "attrs": json.dumps({"gpu.index": 0})}]  # fmt: skip
    batch = Batch(pa.Table.from_pylist(rows, schema=SAMPLES), [], [])
    stale = book.state(("r", 0), {"trainspec.rank": 0})
    time.sleep(0.05)
    book.expire()  # idle and empty: retired
    assert book.sources() == [] and stale.retired
    real_state = book.state
    calls = []

    def looked_up_before_the_expiry(key, resource):
        calls.append(key)
        return stale if len(calls) == 1 else real_state(key, resource)

    book.state = looked_up_before_the_expiry  # type: ignore[method-assign]
    book.apply_batch(("r", 0), {"trainspec.rank": 0}, batch)
    assert len(calls) == 2 and stale.series_keys() == set()
    fresh = real_state(("r", 0), {})
    assert fresh is not stale and len(fresh.series_keys()) == 1
    assert book.budget.series == 1


def test_a_batch_left_off_metrics_is_counted_as_skipped_not_as_a_refused_request():
    """A full feed queue leaves a batch off /metrics; the batch is stored and its request
    answered, so it is no "request refused" (it was counted in rejected_requests)."""
    from trainspec.agent.metrics_feed import MetricsFeed

    feed = MetricsFeed(max_rows=10)  # not started: what is queued stays queued
    assert feed.submit(8, lambda: None)
    assert not feed.submit(8, lambda: None)  # 16 rows > 10
    assert feed.skipped_batches == 1
    feed.close(timeout_s=1.0)
