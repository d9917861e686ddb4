"""The single-process gradient norm: one `_foreach_norm` over every dense gradient, with the
per-device path as its fallback, and torch's own total norm as the reference."""

from __future__ import annotations

import math

import pytest
import torch

from trainspec.collector.gradients import ParameterGradientNorm, dense_gradient_norms


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
    """The zero-code mode hands the script's L2 clip result over (`add_clip`): the step's
    norm is that clip's pre-clip norm with the norm of what it did not cover, each counted
    once, however the optimizers split the parameters."""
    from trainspec.collector.gradients import OptimizerGradientNorm

    body, head = _two_part_model()
    head_before = float(
        torch.linalg.vector_norm(torch.cat([p.grad.flatten() for p in head.parameters()]))
    )
    body_params = list(body.parameters())
    source = OptimizerGradientNorm()
    total = torch.nn.utils.clip_grad_norm_(body_params, 1e-3)  # clips: body's grads now tiny
    source.add_clip(body_params, total)
    # Two optimizers: one over everything (AdamW over the model), one over the head alone.
    everything = torch.optim.SGD([*body.parameters(), *head.parameters()], lr=0.1)
    source.capture(everything)
    summary = source.step_summary()
    assert summary is not None
    want = math.sqrt(float(total) ** 2 + head_before**2)
    assert summary.grad_norm == pytest.approx(want, rel=1e-6)
    # The next step starts clean: nothing of the last step's clip is left out.
    source.capture(everything)
    after = source.step_summary()
    body_now = float(torch.linalg.vector_norm(torch.cat([p.grad.flatten() for p in body_params])))
    assert after is not None
    assert after.grad_norm == pytest.approx(math.sqrt(body_now**2 + head_before**2), rel=1e-6)


def test_a_parameter_clipped_twice_keeps_its_first_clips_norm() -> None:
    from trainspec.collector.gradients import OptimizerGradientNorm

    body, head = _two_part_model()
    params = list(body.parameters())
    source = OptimizerGradientNorm()
    first = torch.nn.utils.clip_grad_norm_(params, 1e-3)
    source.add_clip(params, first)
    second = torch.nn.utils.clip_grad_norm_(params, 1e-6)  # saw clipped gradients
    source.add_clip(params, second)
    source.capture(torch.optim.SGD(params, lr=0.1))
    summary = source.step_summary()
    assert summary is not None and summary.grad_norm == pytest.approx(float(first), rel=1e-6)


@pytest.mark.parametrize(
    ("norm_type", "l2"),
    [(2, True), (2.0, True), ("2", True), (math.inf, False), (1, False), ("x", False)],
)
def test_only_an_l2_clip_gives_the_steps_norm(norm_type: object, l2: bool) -> None:
    from trainspec.runtime.auto import _is_l2

    assert _is_l2(norm_type) is l2
