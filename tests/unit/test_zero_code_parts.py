"""Parts of the zero-code layer that need no job: batch sizes, and which module is the model."""

from __future__ import annotations

import pytest
import torch

from trainspec.runtime.auto import _batch_size
from trainspec.runtime.forward_root import RootForwardFinder


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


def test_the_model_is_the_top_level_module_with_most_of_the_optimizers_parameters():
    starts: list = []
    embed = torch.nn.Embedding(10, 4)  # trainable, called first, 40 parameters
    model = torch.nn.Sequential(torch.nn.Linear(4, 32), torch.nn.Linear(32, 1))  # 193
    frozen = torch.nn.Linear(4, 4).requires_grad_(False)
    finder = RootForwardFinder(lambda inputs: starts.append(inputs), lambda: None)
    try:
        x = frozen(embed(torch.tensor([1, 2, 3])))
        model(x)
        assert len(starts) == 3  # top-level calls only: not the Sequential's Linears
        opt = torch.optim.SGD([*embed.parameters(), *model.parameters()], lr=0.1)
        assert finder.settle(opt) is model
        starts.clear()
        embed(torch.tensor([1]))  # the global hooks are gone: no call is watched but the model's
        assert starts == []
        model(torch.zeros(2, 4))
        assert len(starts) == 1
    finally:
        finder.stop()
