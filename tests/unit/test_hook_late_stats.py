"""The hook's statistics while its totals are in flight (kernels/late_stats.py).

On a GPU the last bucket's totals land in pinned memory some time after the backward returns;
the CPU never shows that, so `HostValues.ready` is held False here to stage it. The figures a
late summary computes must be the ones computed at once, every backward's statistics must be
computed in order, and nothing may read the totals on the way (each read is counted).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel

from trainspec.host_copy import HostValues
from trainspec.kernels import CompressionHook
from trainspec.kernels.late_stats import LateStats

pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("one_rank_group")]


def _job(level: str) -> tuple[Any, CompressionHook]:
    torch.manual_seed(0)
    ddp = DistributedDataParallel(torch.nn.Linear(64, 64), bucket_cap_mb=0.01)
    hook = CompressionHook(level, local_batch_size=4)
    hook.register(ddp)
    return ddp, hook


def _backward(ddp: Any, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    ddp(torch.randn(4, 64, generator=gen)).square().mean().backward()


@pytest.fixture
def in_flight(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """HostValues land only while `landed` is set; reads that had to wait are counted."""
    state: dict[str, Any] = {"landed": False, "early": 0}
    floats = HostValues.floats

    def counted(self: HostValues) -> list[float]:
        if not self.ready():
            state["early"] += 1
        return floats(self)

    monkeypatch.setattr(HostValues, "ready", lambda self: state["landed"])
    monkeypatch.setattr(HostValues, "floats", counted)
    return state


@pytest.mark.parametrize("level", ["none", "bf16", "int8"])
def test_a_late_summary_has_the_figures_computed_at_once(level: str, in_flight) -> None:
    ddp_now, hook_now = _job(level)
    ddp_late, hook_late = _job(level)
    for step in range(3):
        in_flight["landed"] = True  # as on a CPU: computed in the continuation
        _backward(ddp_now, step)
        now = hook_now.step_summary()
        in_flight["landed"] = False
        reads_before = in_flight["early"]
        _backward(ddp_late, step)
        late = hook_late.step_summary()
        assert isinstance(late, LateStats) and not late.ready()
        assert in_flight["early"] == reads_before  # the backward read nothing of its totals
        assert not isinstance(now, LateStats)
        assert late.grad_norm == pytest.approx(now.grad_norm, rel=1e-6)
        assert late.compression == now.compression == level
        assert late.comm_bytes == now.comm_bytes
        assert late.allreduce_s > 0
        assert hook_late.step_summary() is None  # once a step


def test_every_backward_is_computed_in_order_and_bytes_add_up(in_flight) -> None:
    ddp, hook = _job("none")
    _backward(ddp, 0)
    _backward(ddp, 1)  # accumulation without no_sync: two passes, one step
    summary = hook.step_summary()
    assert isinstance(summary, LateStats)
    # the first pass was computed when the second began; the second when read
    assert hook._latest is not None and hook._latest.step == 0
    seconds = summary.allreduce_s
    assert hook._latest.step == 1
    assert seconds >= hook._latest.allreduce_s  # both passes' seconds, the last's included
    assert hook.latest_stats() is hook._latest  # nothing left to compute: no read
    assert hook.step_summary() is None


def test_latest_stats_and_the_next_backward_settle_what_is_in_flight(in_flight) -> None:
    ddp, hook = _job("int8")
    _backward(ddp, 0)
    assert hook._unpublished is not None
    stats = hook.latest_stats()  # a reader who must have it now waits for it
    assert stats is not None and stats.step == 0 and hook._unpublished is None
    _backward(ddp, 1)
    assert hook._unpublished is not None and hook._unpublished.step == 1
    hook.error_feedback()  # a checkpoint between steps sees the step's bookkeeping done
    assert hook._unpublished is None and hook.latest_stats().step == 1


def _void_run(in_flight: dict[str, Any], landed: bool) -> tuple[list[Any], Any]:
    """int8 (error feedback): a step, a step some rank aborted, a step; the void step's
    consumed residuals must be owed again whether its totals landed at once or not."""
    in_flight["landed"] = landed
    ddp, hook = _job("int8")
    _backward(ddp, 0)
    assert hook.abort_step(hook.step, ddp.reducer._get_zeros_like_grad_buckets())
    _backward(ddp, 2)  # its first bucket settles the void step first
    void = hook.take_void_step()
    in_flight["landed"] = True
    pieces = hook.error_feedback()  # by id(parameter): by the model's order here
    return [pieces.get(id(p)) for p in ddp.module.parameters()], void


def test_a_void_step_in_flight_gives_back_what_it_consumed(in_flight) -> None:
    now, void_now = _void_run(in_flight, landed=True)
    late, void_late = _void_run(in_flight, landed=False)
    assert void_now == void_late == 1
    assert all(piece is not None for piece in now)
    for a, b in zip(now, late, strict=True):
        assert b is not None and torch.equal(a, b)


def test_a_void_step_in_flight_summarises_as_none_and_keeps_earlier_bytes(in_flight) -> None:
    ddp, hook = _job("none")
    _backward(ddp, 0)
    first = hook.step_summary()
    assert first.grad_norm is not None
    assert hook.abort_step(hook.step, ddp.reducer._get_zeros_like_grad_buckets())
    void = hook.step_summary()
    assert isinstance(void, LateStats)
    assert void.grad_norm is None and void.comm_bytes is None  # no figures for a void step
    assert hook.take_void_step() == 1


def test_held_noise_terms_do_not_wait_for_a_step_in_flight(in_flight) -> None:
    """A HookSet asks a model that ran no backward this step for its terms: while that
    model's last step is in flight, it gets the step's LateStats, not a wait."""
    ddp, hook = _job("none")
    _backward(ddp, 0)
    summary = hook.step_summary()  # handed out for the step before
    assert isinstance(summary, LateStats)
    reads = in_flight["early"]
    held = hook.held_noise_terms()
    assert held is summary and in_flight["early"] == reads
    in_flight["landed"] = True
    assert held.noise_terms == hook.noise_terms()  # one rank: no estimate, both None
    assert hook.held_noise_terms() == hook.noise_terms()  # nothing in flight: the terms
