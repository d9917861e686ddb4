"""A script's mistakes with the session API: a one-line error naming the argument, at the
call; a value telemetry cannot read costs that value, never the training loop."""

from __future__ import annotations

import logging

import pytest
import torch

import trainspec
import trainspec.store as store


def _tiny() -> torch.nn.Module:
    return torch.nn.Linear(4, 1)


@pytest.mark.parametrize(
    ("kwargs", "error", "needle"),
    [
        ({"model": None}, TypeError, "model must be a torch.nn.Module, not NoneType"),
        ({"model": "model"}, TypeError, "model must be a torch.nn.Module, not str"),
        ({"optimizer": "adam"}, TypeError, "optimizer must be a torch.optim.Optimizer"),
        ({"micro_batch_size": "4"}, TypeError, "micro_batch_size must be a whole number"),
        ({"micro_batch_size": 0}, ValueError, "micro_batch_size must be >= 1"),
    ],
)
def test_wrap_names_a_bad_argument(ts, kwargs, error, needle):
    """`wrap(None)` failed in a weak reference, a string micro-batch size in a comparison."""
    args = {"model": _tiny(), **kwargs}
    with pytest.raises(error, match=needle) as info:
        ts.wrap(args.pop("model"), **args)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(
    ("samples", "needle"),
    [
        (2**63, "below 2\\*\\*63"),
        (10**30, "below 2\\*\\*63"),
        (torch.ones(3, 3), "samples must be"),
    ],
)
def test_a_count_the_store_cannot_hold_is_refused_at_the_step(ts, samples, needle):
    """2**63 samples passed the check and, at the next flush, failed the whole steps table:
    the good steps around it were lost too. An array's repr ran to several lines."""
    with pytest.raises((TypeError, ValueError), match=needle) as info, ts.step(samples=samples):
        pass
    assert "\n" not in str(info.value)


class _Refuses:
    def __float__(self) -> float:
        raise ZeroDivisionError("no")


@pytest.mark.parametrize("loss", [10**400, _Refuses()])
def test_a_loss_telemetry_cannot_read_costs_the_loss_not_the_loop(tmp_path, monkeypatch, loss):
    """10**400 raised OverflowError out of the step's `with`: the script died."""
    from tests.helpers.env import one_process

    one_process(monkeypatch)
    session = trainspec.init(run_root=tmp_path, run_id="r")
    for step in range(3):
        with session.step(samples=4) as s:
            s.loss = loss if step == 1 else 1.0
    session.close()
    rows = store.query(tmp_path / "r", "SELECT step, loss FROM steps ORDER BY step").to_pylist()
    assert [r["step"] for r in rows] == [0, 1, 2] and rows[1]["loss"] is None


@pytest.mark.parametrize(
    ("loss", "said"),
    [("abc", "'abc'"), (torch.ones(3), "a tensor of shape (3,)"), ([1.0], "[1.0]")],
)
def test_a_loss_that_is_no_number_is_said_once_not_dropped_silently(
    tmp_path, monkeypatch, caplog, loss, said
):
    from tests.helpers.env import one_process

    one_process(monkeypatch)
    session = trainspec.init(run_root=tmp_path, run_id="r")
    with caplog.at_level(logging.WARNING, logger="trainspec.runtime"):
        for _ in range(3):
            with session.step(samples=4) as s:
                s.loss = loss
    session.close()
    warned = [r.getMessage() for r in caplog.records if "loss must be one number" in r.getMessage()]
    assert len(warned) == 1 and said in warned[0], warned
    rows = store.query(tmp_path / "r", "SELECT loss FROM steps").to_pylist()
    assert [r["loss"] for r in rows] == [None] * 3


@pytest.mark.parametrize(
    ("device", "error", "needle"),
    [("cuda", ValueError, "CUDA is not available"), (["cpu"], TypeError, "device must be"),
     ("nonsense", ValueError, "'nonsense' is not a device")],
)  # fmt: skip
def test_init_names_a_bad_device(tmp_path, monkeypatch, device, error, needle):
    from tests.helpers.env import one_process

    one_process(monkeypatch)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(error, match=needle) as info:
        trainspec.init(run_root=tmp_path, device=device)
    assert "\n" not in str(info.value)
    with pytest.raises(TypeError, match="run_root must be a path"):
        trainspec.init(run_root=5)


def test_records_dropped_for_a_full_queue_are_said_once(tmp_path, monkeypatch, caplog):
    """A queue capacity of 1 stored 1 step of 5 without a word."""
    from tests.helpers.env import one_process

    one_process(monkeypatch)
    monkeypatch.setenv("TRAINSPEC_COLLECTOR_QUEUE_CAPACITY", "1")
    session = trainspec.init(run_root=tmp_path, run_id="q")
    for _ in range(5):
        with session.step(samples=1):
            pass
    with caplog.at_level(logging.WARNING, logger="trainspec"):
        session.close()
    said = [r.getMessage() for r in caplog.records if "queues were full" in r.getMessage()]
    assert len(said) == 1 and "collector.queue_capacity = 1" in said[0]


def test_a_checkpoint_directory_that_is_a_file_is_named(tmp_path):
    """mkdir's FileExistsError went up through `ts.actuate` and killed every rank."""
    from trainspec.runtime.checkpoint import Checkpointer

    afile = tmp_path / "afile"
    afile.write_text("x")
    with pytest.raises(ValueError, match=f"checkpoint directory {afile} is not a directory"):
        Checkpointer(afile)
