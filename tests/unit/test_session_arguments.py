"""What a script passes to the session is checked at the call: a wrong value raises there,
with its name, instead of failing on the flush thread (and losing every record of that
flush) or at the step's end (replacing the script's own exception)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import trainspec
import trainspec.store as store
from tests.helpers.env import one_process


def _stored_steps(ts) -> list[tuple[int, int]]:
    ts.collector.flush()
    t = store.query(ts.run_dir, "SELECT step, samples FROM steps ORDER BY step")
    return list(zip(t.column("step").to_pylist(), t.column("samples").to_pylist()))


@pytest.mark.parametrize(
    ("samples", "error", "words"),
    [
        ("8", TypeError, "samples must be a whole number, not str"),
        (None, TypeError, "samples must be a whole number, not NoneType"),
        (2.5, TypeError, "samples must be a whole number, not float"),
        (-3, ValueError, "samples must be >= 0, not -3"),
        (True, TypeError, "not a bool"),
    ],
)
def test_a_bad_sample_count_raises_at_the_step(ts, samples, error, words):
    with pytest.raises(error, match=words), ts.step(samples=samples):
        raise AssertionError("the body must not run")


def test_integer_scalars_count_and_later_steps_are_all_stored(ts):
    for samples in (8, np.int64(8), torch.tensor(8)):
        with ts.step(samples=samples):
            pass
    with pytest.raises(TypeError, match="tokens must be a whole number"):
        ts.begin_step(samples=8, tokens=torch.tensor(1.5))
    with ts.step(samples=8, tokens=np.int32(64)):
        pass
    assert _stored_steps(ts) == [(0, 8), (1, 8), (2, 8), (3, 8)]


@pytest.mark.parametrize(
    ("args", "kwargs", "words"),
    [
        (("bogus", "n", "why"), {}, "event kind 'bogus'"),
        (("action", 5, "why"), {}, "event name must be a non-empty string"),
        (("action", "n", ""), {}, "event reason must be a non-empty string"),
        (("action", "n", "why"), {"severity": "whatever"}, "event severity 'whatever'"),
        (("checkpoint", "n", "why"), {"evidence": ["model.pt"]}, "event evidence must be a dict"),
        (("action", "n", "why"), {"evidence": {1: "a", "b": 2}}, "string keys"),
    ],
)
def test_a_bad_event_raises_at_the_call_and_the_flush_keeps_the_rest(ts, args, kwargs, words):
    ts.event("checkpoint", "before", "a good event")
    with pytest.raises((TypeError, ValueError), match=words):
        ts.event(*args, **kwargs)
    ts.event("checkpoint", "after", "another", evidence={"path": "model.pt", "n": np.float32(1)})
    ts.collector.flush()
    names = store.query(ts.run_dir, "SELECT name FROM events ORDER BY ts").column("name")
    assert names.to_pylist() == ["before", "after"]


@pytest.mark.parametrize("flops", ["lots", -1.0, float("nan")])
def test_a_bad_flops_per_sample_raises_at_init(tmp_path, monkeypatch, flops):
    one_process(monkeypatch)
    with pytest.raises((TypeError, ValueError), match="flops_per_sample"):
        trainspec.init(run_root=tmp_path, flops_per_sample=flops)


@pytest.mark.parametrize(
    ("kwargs", "error", "words"),
    [
        ({"dataset_len": 100.0, "global_batch": 8}, TypeError, "dataset_len must be a whole"),
        ({"dataset_len": 100, "global_batch": 8.5}, TypeError, "global_batch must be a whole"),
        ({"dataset_len": 10, "global_batch": 16}, ValueError, "larger than dataset_len 10"),
        ({"dataset_len": 100, "global_batch": 8, "micro_batch": 2.5}, TypeError, "micro_batch"),
        ({"dataset_len": 100, "global_batch": 8, "micro_batch": -1}, ValueError, "micro_batch"),
    ],
)
def test_bad_actuate_arguments_raise_by_name(ts, kwargs, error, words):
    with pytest.raises(error, match=words):
        ts.actuate(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "error", "words"),
    [
        ({"process_group_timeout_s": 0}, ValueError, "process_group_timeout_s must be > 0"),
        ({"process_group_timeout_s": -5}, ValueError, "process_group_timeout_s"),
        ({"process_group_timeout_s": float("nan")}, ValueError, "process_group_timeout_s"),
        ({"process_group_timeout_s": "30"}, TypeError, "process_group_timeout_s"),
        ({"config": {"store": {"root": "x"}}}, TypeError, "config must be a TrainspecConfig"),
        ({"run_id": 5}, TypeError, "run id must be a string, not int"),
    ],
)
def test_bad_init_arguments_raise_by_name(tmp_path, monkeypatch, kwargs, error, words):
    one_process(monkeypatch)
    with pytest.raises(error, match=words):
        trainspec.init(run_root=tmp_path, **kwargs)


def test_an_unreadable_restart_count_does_not_stop_init(tmp_path, monkeypatch):
    one_process(monkeypatch)
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "abc")
    session = trainspec.init(run_root=tmp_path)
    session.close()


def test_checkpoint_dir_in_one_process_saves_and_resumes(ts, tmp_path):
    """A single process (one GPU, no process group) checkpoints alone: `checkpoint_dir` was
    said to be unused, so a one-rank job could never resume, and a 2-rank job's checkpoints
    restarted with one rank were passed over without a word (recovery QA)."""
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    act = ts.actuate(dataset_len=40, global_batch=8, checkpoint_dir=str(tmp_path / "ck"),
                     model=model, optimizer=optimizer)  # fmt: skip
    assert act.checkpointer is not None and act.preemption is not None
    assert act.should_stop(0) is False
    with torch.no_grad():
        model.weight.fill_(0.25)
    act.save_checkpoint(3, "test")
    act.checkpointer.wait()
    act.close()
    act.close()
    with torch.no_grad():
        model.weight.zero_()
    again = ts.actuate(dataset_len=40, global_batch=8, checkpoint_dir=str(tmp_path / "ck"),
                       model=model, optimizer=optimizer)  # fmt: skip
    assert again.resume() == 3  # a checkpoint of step 3: the step the loop starts at
    assert torch.all(model.weight == 0.25)
    again.close()


def test_a_checkpoint_callback_that_is_not_callable_is_refused(ts):
    with pytest.raises(TypeError, match="checkpoint must be a callable"):
        ts.actuate(dataset_len=40, global_batch=8, checkpoint=5)
