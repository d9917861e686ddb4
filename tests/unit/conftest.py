"""Fixtures shared by unit tests."""

from __future__ import annotations

import socket

import pytest


@pytest.fixture(scope="module")
def one_rank_group():
    """A one-rank gloo default group for the module (checkpoint and heartbeat tests)."""
    import torch.distributed as dist

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.fixture
def ts(tmp_path, monkeypatch):
    """A one-process trainspec session on a run root under tmp_path, closed afterwards."""
    import trainspec
    from tests.helpers.env import one_process

    one_process(monkeypatch)
    session = trainspec.init(run_root=tmp_path)
    yield session
    session.close()


@pytest.fixture
def auto(ts):
    """A zero-code layer whose session is `ts`, in a step begun, its DDP model hooked."""
    from trainspec.runtime.auto import AutoInstrumentation

    layer = AutoInstrumentation()
    layer.session, layer.ctx = ts, ts.begin_step()
    layer.ddp_hooked = True
    return layer
