"""A failed collective must fail the bucket's future, never pass as a "sum" of one rank.

torch runs a `.then` callback whether or not its future failed and does not forward the
error itself; a continuation that ignores its argument turned a failed all-reduce into a
result holding this rank's own unreduced gradient, which DDP would then have applied.
"""

from __future__ import annotations

import pytest
import torch

from trainspec.kernels import make_codec
from trainspec.kernels import wire as wire_module
from trainspec.kernels.wire import Wire


class FailedWork:
    def get_future(self) -> torch.futures.Future:
        fut: torch.futures.Future = torch.futures.Future()
        fut.set_exception(RuntimeError("Connection closed by peer"))
        return fut


@pytest.fixture
def broken_wire(monkeypatch) -> Wire:
    monkeypatch.setattr(wire_module.dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(wire_module.dist, "all_reduce", lambda *a, **k: FailedWork())
    monkeypatch.setattr(wire_module.dist, "all_gather", lambda *a, **k: FailedWork())

    class BrokenGroup:  # the hook launches sums on the group itself
        def allreduce(self, tensors, options):
            return FailedWork()

    return Wire(BrokenGroup())


def test_a_failed_all_reduce_fails_its_future(broken_wire):
    with pytest.raises(RuntimeError, match="closed by peer"):
        broken_wire.all_reduce(torch.ones(4)).wait()


def test_the_continuation_is_not_run_on_a_failed_all_reduce(broken_wire):
    ran = []
    fut = broken_wire.all_reduce(torch.ones(4), then=lambda t: ran.append(t))
    with pytest.raises(RuntimeError, match="closed by peer"):
        fut.wait()
    assert ran == []


def test_a_failed_all_gather_fails_its_future(broken_wire):
    with pytest.raises(RuntimeError, match="closed by peer"):
        broken_wire.all_gather(torch.ones(4)).wait()


@pytest.mark.parametrize("level", ["none", "bf16", "int8", "lowrank:2", "lowrank-bf16:2"])
def test_every_level_fails_its_bucket_when_the_wire_fails(broken_wire, level):
    grad = torch.randn(48 * 40)
    fut = make_codec(level).reduce(grad, 0.5, None, 0, broken_wire, [torch.Size((48, 40))])
    with pytest.raises(RuntimeError, match="closed by peer"):
        fut.wait()


@pytest.mark.parametrize("level", ["none", "bf16", "int8", "lowrank:2", "lowrank-bf16:2"])
def test_the_error_reaches_ddp_as_the_collective_s_own_wrapped_once(broken_wire, level):
    """Each `then` link re-raising the error wrapped it ("Got the following error when running
    the callback: ..."): a dead peer's error reached backward() three times over. Inside the
    hook's chain errors pass as they are (`follow`); the future DDP waits on (`for_ddp`) holds
    a torch error, since DDP's C++ reads a Python-set exception as a value."""
    grad = torch.randn(48 * 40)
    fut = make_codec(level).reduce(grad, 0.5, None, 0, broken_wire, [torch.Size((48, 40))])
    for_ddp = wire_module.for_ddp(wire_module.follow(fut, lambda r: r), lambda r: r.summed)
    with pytest.raises(RuntimeError) as raised:
        for_ddp.wait()
    text = str(raised.value)
    assert "closed by peer" in text
    assert text.count("Got the following error when running the callback") == 1, text


def test_an_interrupt_inside_a_callback_fails_the_future_instead_of_leaving_it_unset():
    """`add_done_callback` drops what its callback raises: a KeyboardInterrupt caught only as
    Exception left the future unset and DDP's backward waiting on it forever."""

    def interrupted(_: object) -> None:
        raise KeyboardInterrupt

    done = torch.futures.Future()
    followed = wire_module.follow(done, interrupted)
    chained = wire_module.chain(wire_module.completed(None), interrupted)
    done.set_result(1)
    for fut in (followed, chained):
        assert fut.done()
        with pytest.raises(RuntimeError, match="KeyboardInterrupt"):
            fut.wait()
