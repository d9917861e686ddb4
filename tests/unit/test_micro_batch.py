"""Micro-batches: the split, the accumulated gradient, no_sync, and the OOM retry (one process).

DDP's part is played by `FakeDDP`, which records when `no_sync()` is entered; the real DDP
runs in tests/integration/test_memory_action.py.
"""

from __future__ import annotations

import contextlib
import math

import pytest
import torch

from trainspec.actuator.micro_batch import (
    WHOLE_SHARE,
    MicroBatchPlan,
    accumulation_steps,
    halved,
    split_share,
)
from trainspec.runtime.accumulate import MicroBatchRunner, StepOutOfMemoryError, is_out_of_memory


@pytest.mark.parametrize("n", [1, 5, 8, 11, 16, 33])
@pytest.mark.parametrize("limit", [WHOLE_SHARE, 1, 3, 4, 8, 40])
def test_split_covers_the_share_exactly_within_the_limit(n, limit):
    parts = split_share(n, limit)
    positions = [i for mb in parts for i in range(mb.start, mb.stop)]
    assert positions == list(range(n))  # every sample once, in order
    expected = 1 if limit == WHOLE_SHARE else math.ceil(n / limit)
    assert len(parts) == expected == accumulation_steps(n, limit)
    assert all(mb.size <= (limit or n) for mb in parts)
    assert max(mb.size for mb in parts) - min(mb.size for mb in parts) <= 1  # even, no runt
    assert sum(mb.weight for mb in parts) == pytest.approx(1.0)
    assert [mb.weight for mb in parts] == [mb.size / n for mb in parts]
    assert [mb.last for mb in parts] == [False] * (len(parts) - 1) + [True]


def test_an_empty_share_is_one_placeholder_with_weight_zero():
    (only,) = split_share(0, 4)
    assert (only.start, only.stop, only.weight, only.last) == (0, 1, 0.0, True)


def test_halving_respects_the_minimum_and_reads_the_whole_share_as_its_size():
    assert halved(WHOLE_SHARE, 8, 1) == 4
    assert halved(4, 8, 1) == 2 and halved(3, 8, 2) == 2 and halved(2, 8, 2) == 2
    assert halved(9, 8, 1) == 4  # a limit above the share acts as the share


@pytest.mark.parametrize(
    "configured, minimum, field",
    [(-1, 1, "actuator.micro_batch"), (4, 0, "actuator.min_micro_batch"), (2, 4, "micro_batch 2")],
)
def test_bad_settings_name_the_field(configured, minimum, field):
    with pytest.raises(ValueError, match=field):
        MicroBatchPlan(configured, minimum)


class TinyNet(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = torch.nn.Sequential(
            torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3)
        )
        self.sizes: list[int] = []
        self.fail_above: int | None = None
        self.error: type[BaseException] = torch.OutOfMemoryError

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        self.sizes.append(x.shape[0])
        if self.fail_above is not None and x.shape[0] > self.fail_above:
            raise self.error(f"out of memory: {x.shape[0]} > {self.fail_above}")
        return torch.nn.functional.cross_entropy(self.body(x), y)


class FakeDDP(torch.nn.Module):
    """Has `no_sync()`, as DDP does; records whether each forward ran inside it."""

    def __init__(self, module: torch.nn.Module) -> None:
        super().__init__()
        self.module = module
        self.synced: list[bool] = []
        self._sync = True
        self.require_forward_param_sync = True

    @contextlib.contextmanager
    def no_sync(self):
        self._sync = False
        try:
            yield
        finally:
            self._sync = True

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        self.synced.append(self._sync)
        return self.module(x, y)


def data(n: int = 11) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return torch.randn(n, 6, generator=gen), torch.randint(0, 3, (n,), generator=gen)


def grads(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.grad.reshape(-1) for p in model.parameters()])


def one_shot(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, float]:
    ref = TinyNet()
    loss = ref(x, y)
    loss.backward()
    return grads(ref), float(loss.detach())


def run(model: torch.nn.Module, plan: MicroBatchPlan, x, y, events=None, step: int = 0):
    runner = MicroBatchRunner(
        plan, rank=0, emit=(lambda *a, **k: events.append((a, k))) if events is not None else None
    )

    def forward(mb):
        return model(x[mb.start : mb.stop], y[mb.start : mb.stop])

    return runner, runner.run(step, len(x), forward, model=model)


@pytest.mark.parametrize("limit", [1, 2, 3, 5, 11])
def test_accumulated_gradient_equals_the_one_shot_gradient_of_the_share(limit):
    x, y = data()
    full, full_loss = one_shot(x, y)
    model = TinyNet()
    _, loss = run(model, MicroBatchPlan(limit), x, y)
    diff = float((grads(model) - full).abs().max())
    assert diff <= 1e-6 * max(1.0, float(full.abs().max())), f"max abs diff {diff:.2e}"
    assert float(loss) == pytest.approx(full_loss, rel=1e-6)  # the share's mean loss
    assert model.sizes == [mb.size for mb in split_share(11, limit)]


def test_only_the_last_micro_batch_communicates():
    x, y = data(8)
    ddp = FakeDDP(TinyNet())
    run(ddp, MicroBatchPlan(3), x, y)
    assert ddp.synced == [False, False, True]


def test_an_oom_is_retried_smaller_with_the_same_samples_and_the_same_gradient():
    x, y = data(11)
    full, _ = one_shot(x, y)
    ddp = FakeDDP(TinyNet())
    ddp.module.fail_above = 4
    plan, events = MicroBatchPlan(WHOLE_SHARE), []
    runner, _ = run(ddp, plan, x, y, events, step=7)
    # 11 samples at once fail; halved to 5, the split is 4, 4, 3 (even): all fit
    assert ddp.module.sizes == [11, 4, 4, 3]
    assert (plan.limit, plan.oom_at, runner.retries) == (5, 11, 1)
    assert float((grads(ddp) - full).abs().max()) <= 1e-6
    assert ddp.require_forward_param_sync is False  # no second buffer broadcast this step
    ((args, kw),) = events
    assert args[:2] == ("fault", "oom") and "step 7" in args[2]
    assert kw["before"] == {"micro_batch": 11, "accumulation_steps": 1}
    assert kw["after"] == {"micro_batch": 5, "accumulation_steps": 3}


def test_an_oom_in_the_last_backward_of_a_distributed_step_is_not_retried():
    x, y = data(8)
    ddp = FakeDDP(TinyNet())
    calls = {"n": 0}

    def fail_on_last_backward(grad):
        calls["n"] += 1
        if not ddp.synced or ddp.synced[-1]:  # the backward of the synced micro-batch
            raise torch.OutOfMemoryError("out of memory in backward")
        return grad

    ddp.module.body[0].weight.register_hook(fail_on_last_backward)
    plan = MicroBatchPlan(4)
    with pytest.raises(StepOutOfMemoryError, match="all-reduce"):
        run(ddp, plan, x, y)
    assert plan.limit == 4 and calls["n"] == 2  # no retry, plan unchanged


def test_an_oom_in_a_no_sync_backward_is_retried():
    x, y = data(8)
    full, _ = one_shot(x, y)
    ddp = FakeDDP(TinyNet())
    state = {"fired": False}

    def fail_once_in_no_sync(grad):
        if not ddp.synced[-1] and not state["fired"]:
            state["fired"] = True
            raise torch.OutOfMemoryError("out of memory in backward")
        return grad

    ddp.module.body[0].weight.register_hook(fail_once_in_no_sync)
    plan = MicroBatchPlan(4)
    run(ddp, plan, x, y)
    assert plan.limit == 2 and ddp.synced[-4:] == [False, False, False, True]
    assert float((grads(ddp) - full).abs().max()) <= 1e-6  # the partial accumulation was voided


def test_an_oom_at_the_minimum_is_raised_and_other_errors_pass_through():
    x, y = data(4)
    model = TinyNet()
    model.fail_above = 0
    with pytest.raises(StepOutOfMemoryError, match="minimum"):
        run(model, MicroBatchPlan(2, 2), x, y)
    model.fail_above, model.error = 0, ValueError
    with pytest.raises(ValueError):
        run(model, MicroBatchPlan(2), x, y)


def test_out_of_memory_is_recognised_by_type_or_message():
    assert is_out_of_memory(torch.OutOfMemoryError("x"))
    assert is_out_of_memory(RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    assert not is_out_of_memory(RuntimeError("shape mismatch"))
    assert not is_out_of_memory(MemoryError())


class Reducer:
    def __init__(self) -> None:
        self.resets = 0

    def _reset_state(self) -> None:
        self.resets += 1

    def _get_zeros_like_grad_buckets(self) -> list[str]:
        return ["bucket 0", "bucket 1"]  # what the exchange is handed to complete the step


class Exchange:
    """The gradient hook's side of a voided step: `abort_step` and `take_void_step`."""

    step = 3  # the hook's step counter

    def __init__(self, can_abort: bool = True, void_at: int | None = None) -> None:
        self.can_abort, self.aborted, self.void = can_abort, 0, void_at

    def abort_step(self, step: int, buckets: list[str]) -> bool:
        assert step == self.step  # the runner names the step whose backward failed
        assert buckets == ["bucket 0", "bucket 1"]  # DDP's current layout, from the reducer
        self.aborted += 1
        if self.can_abort:
            self.void = 0  # its own mark, as the hook's statistics all-reduce would set it
        return self.can_abort

    def take_void_step(self) -> int | None:
        step, self.void = self.void, None
        return step


def test_an_oom_in_the_last_backward_voids_the_exchange_and_runs_the_step_again_smaller():
    x, y = data(8)
    full, _ = one_shot(x, y)
    ddp = FakeDDP(TinyNet())
    ddp.reducer = Reducer()
    state = {"fired": False}

    def fail_once_on_last_backward(grad):
        if ddp.synced[-1] and not state["fired"]:
            state["fired"] = True
            raise torch.OutOfMemoryError("out of memory in backward")
        return grad

    ddp.module.body[0].weight.register_hook(fail_once_on_last_backward)
    plan, exchange = MicroBatchPlan(WHOLE_SHARE), Exchange()
    runner = MicroBatchRunner(plan, rank=1, exchange=exchange)
    runner.run(0, 8, lambda mb: ddp(x[mb.start : mb.stop], y[mb.start : mb.stop]), model=ddp)
    assert exchange.aborted == 1 and ddp.reducer.resets == 1 and exchange.void is None
    assert (plan.limit, runner.retries, runner.redone) == (4, 1, 0)
    assert float((grads(ddp) - full).abs().max()) <= 1e-6  # the void attempt left nothing
    assert ddp.require_forward_param_sync is True  # every rank runs the step again, alike


def test_a_step_another_rank_voided_runs_again_unchanged_on_this_rank():
    x, y = data(8)
    full, _ = one_shot(x, y)
    ddp = FakeDDP(TinyNet())
    ddp.reducer = Reducer()
    plan, exchange, events = MicroBatchPlan(3), Exchange(void_at=5), []
    runner = MicroBatchRunner(plan, rank=0, exchange=exchange,
                              emit=lambda *a, **k: events.append(a))  # fmt: skip
    runner.run(5, 8, lambda mb: ddp(x[mb.start : mb.stop], y[mb.start : mb.stop]), model=ddp)
    assert (runner.redone, runner.retries, plan.limit, ddp.reducer.resets) == (1, 0, 3, 1)
    assert ddp.synced == [False, False, True] * 2  # the whole step twice, same split
    assert float((grads(ddp) - full).abs().max()) <= 1e-6  # not the sum of two attempts
    assert events[0][:2] == ("fault", "step_redone") and "step 5" in events[0][2]


def test_an_exchange_that_cannot_be_completed_still_stops_the_step():
    x, y = data(8)
    ddp = FakeDDP(TinyNet())
    ddp.reducer = Reducer()

    def fail(grad):
        raise torch.OutOfMemoryError("out of memory in backward")

    ddp.module.body[0].weight.register_hook(fail)
    exchange = Exchange(can_abort=False)  # e.g. no whole step seen yet
    plan = MicroBatchPlan(WHOLE_SHARE)
    runner = MicroBatchRunner(plan, rank=1, exchange=exchange)
    with pytest.raises(StepOutOfMemoryError, match="cannot be completed"):
        runner.run(0, 8, lambda mb: ddp(x[mb.start : mb.stop], y[mb.start : mb.stop]), model=ddp)
    assert exchange.aborted == 1 and ddp.reducer.resets == 0 and plan.limit == WHOLE_SHARE
