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


def test_at_exit_the_heap_thaws_only_after_the_session_closed(tmp_path, monkeypatch):
    """The thaw's full collection (0.15-0.3 s holding the interpreter) ran at exit before
    the session's close, with the sampling thread still running: a gap in every sampler's
    cadence, which failed validation of every run shorter than a second (QA)."""
    from trainspec.runtime import init as init_module

    gc.unfreeze()
    try:
        session = _init(tmp_path, monkeypatch, "1")
        frozen_at_close = []
        close = session.close
        monkeypatch.setattr(session, "close", lambda **kw: (
            frozen_at_close.append(gc.get_freeze_count()), close(**kw)))  # fmt: skip
        init_module._close_at_exit(session)  # what atexit runs
        assert frozen_at_close and frozen_at_close[0] > 100_000  # still frozen while closing
        assert gc.get_freeze_count() == 0  # thawed after
    finally:
        gc.unfreeze()
