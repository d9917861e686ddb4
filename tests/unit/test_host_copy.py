"""Values read to the host later (host_copy.py) and the statistics built on them.

The no-synchronization property itself needs a GPU (tests/gpu/test_cuda_paths.py); here the
values, their order and what a deferred statistic computes when it is finally read.
"""

from __future__ import annotations

import math

import pytest
import torch

from trainspec.collector.gradients import (
    DeferredNorm,
    OptimizerGradientNorm,
    ParameterGradientNorm,
)
from trainspec.host_copy import HostValues, root_of_sum, single_float
from trainspec.kernels import MicroStepStats
from trainspec.runtime.microsteps import MicroStepGradients


def test_host_values_keep_every_element_in_order() -> None:
    values = HostValues(torch.tensor([1.0, 2.0]), 3, torch.tensor(4.5, dtype=torch.float64))
    assert values.ready()
    assert values.floats() == [1.0, 2.0, 3.0, 4.5]


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (torch.tensor(2.5, requires_grad=True) * 2, 5.0),  # detached, not read through autograd
        (torch.tensor([7.0]), 7.0),
        (3, 3.0),
        (torch.tensor([1.0, 2.0]), None),  # a loss of two values is no loss
        ("high", None),
        (None, None),
    ],
)
def test_a_single_float_is_read_or_none(value: object, expected: float | None) -> None:
    holder = None if value is None else HostValues(value)
    assert single_float(holder) == expected


def test_the_value_is_what_it_was_when_copied() -> None:
    loss = torch.tensor(1.0)
    held = HostValues(loss)
    loss.add_(5.0)  # a script that accumulates its loss in place, zeroed each step
    assert single_float(held) == 1.0
    numpy = pytest.importorskip("numpy")
    running = numpy.zeros(())
    held = HostValues(running)
    running += 5.0  # numpy's 0-d arrays change in place too
    assert single_float(held) == 0.0


def test_root_of_a_sum_that_is_not_finite_is_nan() -> None:
    assert root_of_sum(HostValues(torch.tensor(9.0), torch.tensor(16.0))) == 5.0
    assert math.isnan(root_of_sum(HostValues(torch.tensor(float("inf")))))
    assert math.isnan(root_of_sum(HostValues(torch.tensor(float("nan")))))


def test_parameter_norm_is_read_when_asked_not_when_taken() -> None:
    a = torch.nn.Parameter(torch.zeros(3))
    a.grad = torch.full((3,), 2.0)
    source = ParameterGradientNorm([a])
    assert source.step_summary() is None
    source.capture()
    a.grad.zero_()  # the optimizer zeroes gradients before the record is made
    summary = source.step_summary()
    assert isinstance(summary, DeferredNorm) and summary.ready()
    assert summary.grad_norm == pytest.approx(12**0.5)
    assert summary.grad_variance is None and summary.compression is None
    assert source.step_summary() is None  # taken once


def test_optimizer_norm_adds_every_optimizer_of_the_step() -> None:
    a, b = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(1))
    a.grad, b.grad = torch.full((2,), 3.0), torch.full((1,), 4.0)
    norm = OptimizerGradientNorm()
    norm.capture(torch.optim.SGD([a], lr=0.1))
    norm.capture(torch.optim.SGD([b], lr=0.1))
    assert norm.step_summary().grad_norm == pytest.approx((18 + 16) ** 0.5)
    assert norm.step_summary() is None


def _observe_steps(stats: MicroStepStats, gen: torch.Generator, steps: int) -> list[object]:
    """`steps` steps of 3 micro-steps, each ended with take_step (nothing read yet)."""
    w = torch.nn.Parameter(torch.zeros(16))
    taken = []
    for _ in range(steps):
        w.grad = None
        for _ in range(3):
            (w * torch.randn(16, generator=gen)).sum().div(3).backward()
            stats.observe([w])
        taken.append(stats.take_step())
    return taken


def test_deferred_micro_step_statistics_equal_those_read_at_once() -> None:
    at_once, later = MicroStepStats(4), MicroStepStats(4)
    gen_a, gen_b = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    w = torch.nn.Parameter(torch.zeros(16))
    now = []
    for _ in range(5):
        w.grad = None
        for _ in range(3):
            (w * torch.randn(16, generator=gen_a)).sum().div(3).backward()
            at_once.observe([w])
        now.append(at_once.finish_step())
    # the same steps, every one taken before any is read (a device running behind)
    taken = _observe_steps(later, gen_b, 5)
    read = [later.stats_of(MicroStepStats.combine([t.tolist() for t in ts])) for ts in taken]
    for a, b in zip(now, read, strict=True):
        assert a.grad_norm == pytest.approx(b.grad_norm, rel=1e-12)
        assert a.grad_variance == pytest.approx(b.grad_variance, rel=1e-12)
        assert a.grad_noise_scale == pytest.approx(b.grad_noise_scale, rel=1e-12)  # EMA order
        assert a.step == b.step


def test_micro_step_source_defers_until_read() -> None:
    w = torch.nn.Parameter(torch.zeros(8))
    source = MicroStepGradients([w], micro_batch_size=2)
    for _ in range(2):
        ((w * torch.arange(8.0)).sum() / 2).backward()  # the loss divided by the 2 steps
        source.after_backward()
    source.before_update()
    summary = source.step_summary()
    assert summary is not None and summary.ready()
    # two identical micro-steps: .grad ends as their mean, 0..7, with no spread between them
    assert summary.grad_norm == pytest.approx(float(torch.arange(8.0).norm()))
    assert summary.grad_variance == pytest.approx(0.0, abs=1e-9)
    assert summary.comm_bytes == 0 and summary.compression == "none"


def test_two_updates_in_one_step_move_the_ema_as_when_read_at_once() -> None:
    """A recorded step whose model two optimizers update: two taken steps, one summary read.
    The unread one is still computed, first, so the noise scale is the eager code's."""
    gen_a, gen_b = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    eager = MicroStepStats(2)
    w_a = torch.nn.Parameter(torch.zeros(16))
    expected = []
    w_b = torch.nn.Parameter(torch.zeros(16))
    source = MicroStepGradients([w_b], micro_batch_size=2)
    got = []
    for _ in range(4):
        for _ in range(2):  # two updates, each after two micro-steps
            w_a.grad = w_b.grad = None
            for _ in range(2):
                (w_a * torch.randn(16, generator=gen_a)).sum().div(2).backward()
                eager.observe([w_a])
                (w_b * torch.randn(16, generator=gen_b)).sum().div(2).backward()
                source.after_backward()
            last = eager.finish_step()
            source.before_update()
        expected.append(last.grad_noise_scale)
        got.append(source.step_summary().grad_noise_scale)
    assert got == pytest.approx(expected, rel=1e-12)


def test_summaries_nobody_reads_stay_bounded() -> None:
    w = torch.nn.Parameter(torch.zeros(4))
    source = MicroStepGradients([w], micro_batch_size=1)
    for _ in range(50):
        (w * torch.ones(4)).sum().backward()
        source.after_backward()
        source.before_update()
    assert len(source._unread) <= 8


def test_a_step_whose_values_are_in_flight_is_recorded_once_they_land(ts, monkeypatch) -> None:
    """What a CUDA step looks like to the session (ready() False while a copy is in flight,
    which the CPU never shows): its record waits, later steps queue behind it in order, and
    close() records what is left."""
    landed = {"yes": False}
    monkeypatch.setattr(HostValues, "ready", lambda self: landed["yes"])
    seen: list[tuple[int, float | None]] = []
    ts.record_listeners.append(lambda record: seen.append((record.step, record.loss)))
    for k in range(3):
        with ts.step(samples=1) as s:
            s.loss = torch.tensor(float(k))
    assert seen == []  # held back
    landed["yes"] = True
    with ts.step(samples=1) as s:
        s.loss = torch.tensor(3.0)
    assert seen == [(0, 0.0), (1, 1.0), (2, 2.0), (3, 3.0)]
    landed["yes"] = False
    with ts.step(samples=1) as s:
        s.loss = torch.tensor(4.0)
    assert len(seen) == 4
    ts.close()
    assert seen[-1] == (4, 4.0)


def test_readers_on_several_threads_give_the_buffers_back_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A GradScaler's scale is read by the step's record and by the DDP hook's continuation:
    a pooled pinned buffer given back twice would be lent to two later copies at once."""
    import threading
    import time

    given: list[object] = []

    class Pool:
        def give_back(self, things: list[object]) -> None:
            given.extend(things)

    values = HostValues(torch.tensor(3.0))
    buffer = object()
    values._lent.append((Pool(), buffer))  # type: ignore[arg-type]
    read = HostValues._values

    reads_after_give_back: list[int] = []

    def slow(self: HostValues) -> list[float]:
        time.sleep(0.05)  # every reader inside the read at once, were it not one at a time
        reads_after_give_back.append(len(given))  # a buffer handed on may be refilled now
        return read(self)

    monkeypatch.setattr(HostValues, "_values", slow)
    start = threading.Barrier(4)
    results: list[list[float]] = []

    def reader() -> None:
        start.wait()
        results.append(values.floats())

    threads = [threading.Thread(target=reader) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=10)
    assert results == [[3.0]] * 4
    assert given == [buffer]
    assert reads_after_give_back == [0]  # one read, before the buffer went back
