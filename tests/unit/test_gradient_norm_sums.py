"""The single-process gradient norm: one `_foreach_norm` over every dense gradient, with the
per-device path as its fallback, and torch's own total norm as the reference."""

from __future__ import annotations

import math

import pytest
import torch

from trainspec.collector.gradients import (
    ClipRecord,
    ParameterGradientNorm,
    dense_grads,
    foreach_norms,
)


def dense_gradient_norms(parameters: list[torch.nn.Parameter]) -> list[torch.Tensor]:
    return foreach_norms(dense_grads(parameters), parameters)


def test_dense_norms_skip_missing_and_sparse_gradients() -> None:
    dense = torch.nn.Parameter(torch.zeros(3))
    dense.grad = torch.tensor([3.0, 0.0, 4.0])
    sparse = torch.nn.Parameter(torch.zeros(3))
    sparse.grad = torch.tensor([0.0, 7.0, 0.0]).to_sparse()
    untouched = torch.nn.Parameter(torch.zeros(2))
    norms = dense_gradient_norms([dense, sparse, untouched])
    assert [float(n) for n in norms] == [5.0]
    assert dense_gradient_norms([untouched]) == []


def test_a_torch_whose_foreach_norm_refuses_falls_back_per_device(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    a, b = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(1))
    a.grad, b.grad = torch.tensor([3.0, 4.0]), torch.tensor([12.0])
    foreach = torch._foreach_norm
    calls: list[int] = []

    def one_device_only(tensors: list[torch.Tensor], *args: object) -> object:
        calls.append(len(tensors))
        if len(calls) == 1:
            raise RuntimeError("expected all tensors to be on the same device")
        return foreach(tensors, *args)

    monkeypatch.setattr(torch, "_foreach_norm", one_device_only)
    assert sorted(float(n) for n in dense_gradient_norms([a, b])) == [5.0, 12.0]
    assert len(calls) == 2


def test_the_captured_norm_is_torchs_total_norm() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.ReLU(), torch.nn.Linear(7, 2))
    model(torch.randn(4, 5)).square().sum().backward()
    norm = ParameterGradientNorm(model.parameters())
    norm.capture()
    summary = norm.step_summary()
    assert summary is not None
    expected = torch.nn.utils.clip_grad_norm_(model.parameters(), math.inf, norm_type=2.0)
    assert summary.grad_norm == pytest.approx(float(expected), rel=1e-6)


def _two_part_model() -> tuple[torch.nn.Module, torch.nn.Module]:
    torch.manual_seed(1)
    body, head = torch.nn.Linear(6, 5), torch.nn.Linear(5, 3)
    head(body(torch.randn(4, 6))).square().sum().backward()
    return body, head


def test_a_clips_norm_is_its_parameters_share_and_the_optimizers_leave_them_out() -> None:
    """The zero-code mode hands the script's L2 clip results over (`clips`): the step's norm
    is each clip's pre-clip norm, counted once however many optimizers step, with the norm
    of what no clip covered."""
    from trainspec.collector.gradients import OptimizerGradientNorm

    body, head = _two_part_model()
    head_before = float(
        torch.linalg.vector_norm(torch.cat([p.grad.flatten() for p in head.parameters()]))
    )
    body_params = list(body.parameters())
    source = OptimizerGradientNorm()
    total = torch.nn.utils.clip_grad_norm_(body_params, 1e-3)  # clips: body's grads now tiny
    clips = [ClipRecord(frozenset(map(id, body_params)), total)]
    # Two optimizers over the two parts, both stepping in the step: the clip counts once.
    source.capture(torch.optim.SGD(body_params, lr=0.1), clips=clips)
    source.capture(torch.optim.SGD(head.parameters(), lr=0.1), clips=clips)
    summary = source.step_summary()
    assert summary is not None
    assert summary.grad_norm == pytest.approx(
        math.sqrt(float(total) ** 2 + head_before**2), rel=1e-6
    )
    # The next step, no clip: everything as it is now.
    source.capture(torch.optim.SGD([*body_params, *head.parameters()], lr=0.1))
    after = source.step_summary()
    body_now = float(torch.linalg.vector_norm(torch.cat([p.grad.flatten() for p in body_params])))
    assert after is not None
    assert after.grad_norm == pytest.approx(math.sqrt(body_now**2 + head_before**2), rel=1e-6)


def test_a_step_end_noticed_late_keeps_the_next_steps_clip_in_the_next_step() -> None:
    """The zero-code mode sometimes sees a step end only at the next optimizer step, after
    the next step's clip: that clip is handed over at the read, after the late summary, so
    it lands in its own step."""
    from trainspec.collector.gradients import OptimizerGradientNorm

    body, _ = _two_part_model()
    params = list(body.parameters())
    opt = torch.optim.SGD(params, lr=0.1)
    source = OptimizerGradientNorm()
    first = [ClipRecord(frozenset(map(id, params)), torch.tensor(3.0))]
    source.capture(opt, clips=first)  # step k
    second = [ClipRecord(frozenset(map(id, params)), torch.tensor(4.0))]  # k + 1's, pending
    late = source.step_summary()  # step k's end, noticed at step k + 1's optimizer step
    source.capture(opt, clips=second)
    assert late is not None and late.grad_norm == pytest.approx(3.0)
    now = source.step_summary()
    assert now is not None and now.grad_norm == pytest.approx(4.0)


def test_the_zero_code_layer_keeps_l2_clips_until_an_optimizer_reads_them() -> None:
    """Before any session exists (one that starts at the first optimizer step), the clip
    is kept, and a second clip over the same parameters is told it saw clipped gradients."""
    from trainspec.runtime.auto import AutoInstrumentation

    body, head = _two_part_model()
    auto = AutoInstrumentation()
    assert auto.session is None
    params = list(body.parameters())
    total = torch.nn.utils.clip_grad_norm_(params, 1e-3)
    auto.after_clip(params, total)
    (record,) = auto._clips
    assert record.params == frozenset(map(id, params)) and record.norm is total
    assert not auto.clip_reusable(params[:1]) and auto.clip_reusable(list(head.parameters()))


def test_a_clip_record_counts_once_across_step_ends_and_reads() -> None:
    """Counted by identity: still listed at a read after the step ended (no backward
    between two optimizers), it is not counted again; a new record of the same parameters
    is (the old `id()` bookkeeping could take a freed record's successor for it)."""
    from trainspec.collector.gradients import OptimizerGradientNorm

    body, _ = _two_part_model()
    params = list(body.parameters())
    opt = torch.optim.SGD(params, lr=0.1)
    source = OptimizerGradientNorm()
    clips = [ClipRecord(frozenset(map(id, params)), torch.tensor(3.0))]
    source.capture(opt, clips=clips)
    first = source.step_summary()
    source.capture(opt, clips=clips)  # the same record, a step later: nothing to add
    assert first is not None and first.grad_norm == pytest.approx(3.0)
    assert source.step_summary() is None
    clips[0] = ClipRecord(frozenset(map(id, params)), torch.tensor(4.0))
    source.capture(opt, clips=clips)
    again = source.step_summary()
    assert again is not None and again.grad_norm == pytest.approx(4.0)


def test_a_clip_after_another_clip_or_a_read_is_not_reused() -> None:
    """An L2 clip reuses its result only on gradients nothing in the step clipped or read:
    after an inf-norm clip its result is of clipped gradients; after an optimizer read some
    of them it would count them twice. The per-parameter read before a clip keeps the
    first, raw, value."""
    from trainspec.collector.gradients import OptimizerGradientNorm
    from trainspec.runtime.auto import AutoInstrumentation

    body, head = _two_part_model()
    params = list(body.parameters())
    raw = {id(p): float(p.grad.norm()) for p in params}
    auto = AutoInstrumentation()
    assert auto.clip_reusable(params)
    auto.before_clip(params)  # an inf-norm clip is about to run
    torch.nn.utils.clip_grad_norm_(params, 1e-3, norm_type=math.inf)
    assert not auto.clip_reusable(params)  # an L2 clip now would measure clipped gradients
    auto.before_clip(params)  # ... so it reads before it, and the raw values stay
    assert {k: float(v) for k, v in auto._clipped.items()} == pytest.approx(raw)

    auto = AutoInstrumentation()
    auto._optimizer_norm = source = OptimizerGradientNorm()
    source.capture(torch.optim.SGD(head.parameters(), lr=0.1))  # head read by its optimizer
    assert not auto.clip_reusable([*params, *head.parameters()])
    assert auto.clip_reusable(params)
    source.step_summary()  # a new step: nothing read yet
    assert auto.clip_reusable([*params, *head.parameters()])
    source.capture(torch.optim.SGD(head.parameters(), lr=0.1))
    # A step end the layer notices only at the next optimizer step leaves the summary
    # until after the next step's clip: the backward before that clip is the reset.
    source.new_gradients()
    assert auto.clip_reusable([*params, *head.parameters()])
    auto.explicit = True  # stood down, nothing is read: every clip runs as it is
    assert not auto.clip_reusable(params)


@pytest.mark.parametrize(
    ("norm_type", "l2"),
    [(2, True), (2.0, True), ("2", True), (math.inf, False), (1, False), ("x", False)],
)
def test_only_an_l2_clip_gives_the_steps_norm(norm_type: object, l2: bool) -> None:
    from trainspec.runtime.auto import _is_l2

    assert _is_l2(norm_type) is l2


def test_squared_sums_are_one_per_device() -> None:
    """One device: one sum of every square. Norms on two devices (here the CPU and the meta
    device, which torch will not stack together): one sum per device, none moved."""
    from trainspec.collector.gradients import squared_sums

    (one,) = squared_sums(
        [torch.tensor(3.0), torch.tensor(4.0), torch.tensor(12.0, dtype=torch.bfloat16)]
    )
    assert float(one) == 169.0 and one.dim() == 0
    cpu, meta = squared_sums([torch.tensor(3.0), torch.empty((), device="meta"), torch.tensor(4.0)])
    assert float(cpu) == 25.0 and meta.device.type == "meta"
    assert squared_sums([]) == []
