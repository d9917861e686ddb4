"""Single process with gradient accumulation: variance and noise scale across micro-steps."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from trainspec.collector.sinks.memory import InMemorySink
from trainspec.config import load_config
from trainspec.runtime.init import init


@pytest.mark.parametrize("micro", [None, 8])
def test_single_process_statistics(tmp_path, monkeypatch, micro):
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(key, raising=False)
    cfg = load_config(environ={})
    ts = init(run_root=tmp_path, run_id="micro", config=cfg)
    sink = InMemorySink()
    ts.collector.sinks.append(sink)
    torch.manual_seed(0)
    model = nn.Linear(16, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    model = ts.wrap(model, optimizer=opt, micro_batch_size=micro)
    for _ in range(6):
        with ts.step(samples=32) as s:
            opt.zero_grad()
            for _ in range(4):  # 4 micro-steps of 8 samples
                x, y = torch.randn(8, 16), torch.randn(8, 1)
                loss = nn.functional.mse_loss(model(x), y) / 4
                with s.phase("backward"):
                    loss.backward()
            opt.step()
    ts.close()
    steps = sink.steps()
    assert len(steps) == 6 and all(r.grad_norm and r.grad_norm > 0 for r in steps)
    variances = [r.grad_variance for r in steps]
    if micro is None:
        assert variances == [None] * 6  # one gradient per step: nothing to compare
    else:
        assert all(v is not None for v in variances) and max(variances) > 0
