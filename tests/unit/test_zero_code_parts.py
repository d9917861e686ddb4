"""Parts of the zero-code layer that need no job: batch sizes."""

from __future__ import annotations

import pytest
import torch

from trainspec.runtime.batches import batch_size as _batch_size


@pytest.mark.parametrize(
    ("batch", "size"),
    [
        (torch.zeros(6, 3), 6),
        ((torch.zeros(5, 2), torch.zeros(5)), 5),
        ({"text": ["a", "b", "c"], "ids": torch.zeros(3, 7)}, 3),  # a tensor, not the text
        (["some text", "more text"], 2),  # a list of plain items: its length
        ({"label": torch.tensor(1.0)}, 0),  # a 0-d tensor says nothing
        ([{"a": 1}, {"a": 2}], 0),
        (None, 0),
    ],
)
def test_the_batch_size_is_the_first_tensor_s_first_dimension(batch, size):
    assert _batch_size(batch) == size


def test_a_failing_entry_point_is_contained_logged_once_and_counted(caplog):
    from trainspec.runtime.auto import AutoInstrumentation, contained

    auto = AutoInstrumentation()

    def broken() -> None:
        raise RuntimeError("NestedTensorImpl doesn't support sizes")

    with caplog.at_level("WARNING", logger="trainspec.runtime"):
        assert contained(auto, broken) is None
        assert contained(auto, broken) is None
    assert auto.failures == 2
    assert len([r for r in caplog.records if "instrumentation failed" in r.getMessage()]) == 1


def test_a_nested_tensor_counts_no_samples_instead_of_raising():
    nested = torch.nested.nested_tensor([torch.zeros(2, 3), torch.zeros(4, 3)])
    assert _batch_size((nested,)) == 0


def test_the_optimizer_norm_takes_each_parameter_as_it_was_before_a_clip():
    from trainspec.collector.gradients import OptimizerGradientNorm, gradient_norms

    a, b = torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(4))
    a.grad, b.grad = torch.full((3,), 2.0), torch.full((4,), 1.0)
    opt = torch.optim.SGD([{"params": [a]}, {"params": [b]}], lr=0.1)
    before = gradient_norms([a])  # one group clipped by the script: |a.grad| = sqrt(12)
    a.grad.mul_(0.01)
    norm = OptimizerGradientNorm()
    norm.capture(opt, before_clip=before)
    assert norm.step_summary().grad_norm == pytest.approx((12 + 4) ** 0.5)
    norm.capture(opt)  # no clip: as the gradients are now
    assert norm.step_summary().grad_norm == pytest.approx((12e-4 + 4) ** 0.5)
