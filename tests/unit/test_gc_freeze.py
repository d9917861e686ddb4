"""Set-up ends with one full garbage collection and a freeze (collector.gc_freeze), so the
cyclic collector's first full pass over the libraries' objects does not land mid-training."""

from __future__ import annotations

import gc

import trainspec
from tests.helpers.env import one_process


def _init(tmp_path, monkeypatch, freeze: str):
    one_process(monkeypatch)
    monkeypatch.setenv("TRAINSPEC_COLLECTOR_GC_FREEZE", freeze)
    return trainspec.init(run_root=tmp_path)


def test_set_up_freezes_its_heap_unless_told_not_to(tmp_path, monkeypatch):
    gc.unfreeze()
    try:
        _init(tmp_path, monkeypatch, "0").close()
        assert gc.get_freeze_count() == 0
        _init(tmp_path, monkeypatch, "1").close()
        assert gc.get_freeze_count() > 100_000  # torch's, pyarrow's, DuckDB's objects
    finally:
        gc.unfreeze()
