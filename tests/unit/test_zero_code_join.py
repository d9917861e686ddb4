"""DDP's join (uneven inputs) under the zero-code layer, in a one-rank group: the shadow
passes a rank whose data ran out runs for the other ranks' steps are none of its steps."""

from __future__ import annotations

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel

import trainspec.store as store
from trainspec.runtime.auto import AutoInstrumentation, _join_shadow_pass
from trainspec.runtime.hook_wiring import SHADOW_PASS

pytestmark = pytest.mark.usefixtures("one_rank_group")


@pytest.fixture
def auto(ts, monkeypatch) -> AutoInstrumentation:
    layer = AutoInstrumentation()
    layer.session, layer.ctx = ts, ts.begin_step()
    original = getattr(DistributedDataParallel, SHADOW_PASS)
    monkeypatch.setattr(DistributedDataParallel, SHADOW_PASS, _join_shadow_pass(layer, original))
    return layer


def test_a_rank_s_last_step_before_its_join_keeps_its_own_figures(auto):
    """The shadow passes' zero gradients gave the last step a gradient norm of 0 (with two
    ranks: the others' last step's norm, and 4 passes' bytes), QA 2026-11-27."""
    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Linear(4, 1))
    auto.on_ddp_model(model)  # as the patched `DistributedDataParallel.__init__`
    auto.session.grad_source = auto.session.attach_hook(model)  # as at its first forward
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    norms = []
    for _ in range(3):
        auto.on_batch(torch.zeros(8, 4), 0.0, "loader")
        model(torch.randn(8, 4)).square().sum().backward()  # its hooks report the forward
        norms.append(torch.cat([p.grad.flatten() for p in model.parameters()]).norm().item())
        auto.on_optimizer_pre(opt)
        opt.step()
        auto.on_optimizer_post(opt)
        opt.zero_grad()
    for _ in range(2):  # the join: its data ran out, the other ranks train on
        model._match_all_reduce_for_bwd_pass()
    auto.close()
    run = auto.session.run_dir
    rows = store.query(run, "SELECT step, grad_norm FROM steps ORDER BY step").to_pylist()
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert [r["grad_norm"] for r in rows] == pytest.approx(norms, rel=1e-5)
    events = store.query(run, "SELECT step, kind, name FROM events").to_pylist()
    assert events == [{"step": 3, "kind": "anomaly", "name": "uneven_inputs"}]
