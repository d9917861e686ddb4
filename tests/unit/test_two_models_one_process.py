"""Two models wrapped in one process (no DDP, no hook): the step's gradient norm covers
both, each model's taken at its own update (collector/gradients.py ParameterGradientNorm)."""

from __future__ import annotations

import logging
import math
from pathlib import Path

import pytest
import torch

import trainspec
import trainspec.store as store
from tests.helpers.env import one_process


def _mlp() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 8))


def _run_dir(root: Path) -> Path:
    (run,) = [p for p in root.iterdir() if p.is_dir()]
    return run


@pytest.mark.parametrize("optimizers", ["one", "each"])
def test_the_stored_norm_is_over_both_models(tmp_path, monkeypatch, optimizers) -> None:
    one_process(monkeypatch)
    ts = trainspec.init(run_root=tmp_path)
    torch.manual_seed(0)
    nets = [_mlp(), _mlp()]
    if optimizers == "one":
        opt = torch.optim.SGD([p for n in nets for p in n.parameters()], lr=0.1)
        opts = [opt, opt]
    else:
        opts = [torch.optim.SGD(n.parameters(), lr=0.1) for n in nets]
    first, second = (ts.wrap(n, optimizer=o) for n, o in zip(nets, opts, strict=True))
    x = torch.randn(4, 8)
    want = []
    for _ in range(5):
        with ts.step(samples=4):
            second(first(x)).pow(2).mean().backward()
            want.append(
                math.sqrt(sum(float(p.grad.pow(2).sum()) for n in nets for p in n.parameters()))
            )
            for o in dict.fromkeys(opts):  # the shared optimizer steps once
                o.step()
                o.zero_grad()
    ts.close()
    rows = store.query(_run_dir(tmp_path), "SELECT grad_norm FROM steps ORDER BY step").to_pylist()
    assert [r["grad_norm"] for r in rows] == pytest.approx(want, rel=1e-5)


def test_a_model_with_micro_steps_after_another_says_what_the_statistics_cover(
    tmp_path, monkeypatch, caplog
) -> None:
    one_process(monkeypatch)
    ts = trainspec.init(run_root=tmp_path)
    nets = [_mlp(), _mlp()]
    ts.wrap(nets[0], optimizer=torch.optim.SGD(nets[0].parameters(), lr=0.1))
    with caplog.at_level(logging.WARNING, logger="trainspec.runtime"):
        ts.wrap(
            nets[1], optimizer=torch.optim.SGD(nets[1].parameters(), lr=0.1), micro_batch_size=2
        )
    ts.close()
    assert any("model wrapped last only" in r.getMessage() for r in caplog.records)


def test_a_model_wrapped_twice_counts_its_gradients_once(tmp_path, monkeypatch) -> None:
    one_process(monkeypatch)
    ts = trainspec.init(run_root=tmp_path)
    net = _mlp()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    model = ts.wrap(ts.wrap(net, optimizer=opt), optimizer=opt)
    with ts.step(samples=4):
        model(torch.randn(4, 8)).pow(2).mean().backward()
        want = math.sqrt(sum(float(p.grad.pow(2).sum()) for p in net.parameters()))
        opt.step()
    ts.close()
    (row,) = store.query(_run_dir(tmp_path), "SELECT grad_norm FROM steps").to_pylist()
    assert row["grad_norm"] == pytest.approx(want, rel=1e-5)
