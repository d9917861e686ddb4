"""A run id from the environment that is not a plain directory name never puts the run
outside the store root, and never stops the job: a new id is used, with a warning."""

from __future__ import annotations

import logging

import pytest

import trainspec
from tests.helpers.env import one_process


@pytest.mark.parametrize("bad", ["../../etc/x", "a/b", ".."])
def test_a_bad_run_id_from_the_environment_gets_a_new_one(bad, tmp_path, monkeypatch, caplog):
    one_process(monkeypatch)
    monkeypatch.setenv("TRAINSPEC_STORE_RUN_ID", bad)
    with caplog.at_level(logging.WARNING, logger="trainspec"):
        ts = trainspec.init(run_root=tmp_path / "runs")
    try:
        assert ts.run_dir.parent == tmp_path / "runs" and ts.run_id != bad
        assert "not a plain directory name" in caplog.text
    finally:
        ts.close()
    assert not (tmp_path / "etc").exists()


def test_a_bad_run_id_argument_is_the_callers_error(tmp_path):
    with pytest.raises(ValueError, match="not a plain directory name"):
        trainspec.init(run_root=tmp_path, run_id="../x")


def test_a_second_job_on_the_same_run_id_is_warned_a_restart_is_not(tmp_path, monkeypatch, caplog):
    one_process(monkeypatch)
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    with caplog.at_level(logging.WARNING, logger="trainspec"):
        trainspec.init(run_root=tmp_path, run_id="dup").close()
        assert "already holds" not in caplog.text  # the first job
        trainspec.init(run_root=tmp_path, run_id="dup").close()
        assert "run dup already holds rank 0's rows from an earlier job" in caplog.text
        caplog.clear()
        monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")  # torchrun restarted this job
        trainspec.init(run_root=tmp_path, run_id="dup").close()
        assert "already holds" not in caplog.text


def test_a_second_init_in_one_process_returns_the_running_session(tmp_path, monkeypatch, caplog):
    one_process(monkeypatch)
    first = trainspec.init(run_root=tmp_path, run_id="one")
    try:
        with caplog.at_level(logging.WARNING, logger="trainspec"):
            assert trainspec.init(run_root=tmp_path, run_id="two") is first
        assert "init called again" in caplog.text
    finally:
        first.close()
    second = trainspec.init(run_root=tmp_path, run_id="two")  # after close: a new one
    second.close()
    assert second is not first and second.run_id == "two"
