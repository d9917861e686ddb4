"""Gradient statistics read during backward are reported in the gradient's own units under a
GradScaler: the norm divided by the loss scale, the variance by its square."""

from __future__ import annotations

import torch

from trainspec.collector.gradients import GradientSummary, ParameterGradientNorm
from trainspec.runtime import loss_scale
from trainspec.runtime.step_values import _unscaled


def test_each_scale_call_records_the_scale_it_applied_and_take_reads_it_once():
    loss_scale.install()
    loss_scale.install()  # idempotent: one wrapper, not two
    loss_scale.take()
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    scaled = scaler.scale(torch.tensor(2.0))
    assert float(scaled) == 2048.0
    assert loss_scale.value(loss_scale.take()) == 1024.0
    assert loss_scale.take() is None
    torch.amp.GradScaler("cpu", enabled=False).scale(torch.tensor(1.0))
    assert loss_scale.take() is None  # a disabled scaler scales nothing


def test_a_scale_that_is_no_positive_number_is_none():
    for bad in (None, "x", torch.tensor(0.0), torch.tensor(float("inf")), -2.0):
        assert loss_scale.value(bad) is None


def test_what_backward_saw_is_divided_and_what_the_optimizer_saw_is_left():
    seen = GradientSummary(grad_norm=1024.0 * 3, grad_variance=1024.0**2 * 5, grad_noise_scale=7)
    backward_source = object()  # the DDP hook or micro-steps: read during backward
    g = _unscaled(seen, torch.tensor(1024.0), backward_source)
    assert (g.grad_norm, g.grad_variance, g.grad_noise_scale) == (3.0, 5.0, 7)
    optimizer_source = ParameterGradientNorm([])  # at the optimizer step: already unscaled
    assert _unscaled(seen, torch.tensor(1024.0), optimizer_source) is seen
    assert _unscaled(seen, None, backward_source) is seen


def test_the_session_stores_the_unscaled_norm(ts):
    ts.grad_source = object()
    g = ts._values.gradients(0, GradientSummary(grad_norm=2048.0), torch.tensor(1024.0), object())
    assert g.grad_norm == 2.0
