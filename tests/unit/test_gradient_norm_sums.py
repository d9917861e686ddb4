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
