"""Side process groups: telemetry and control never share the training group.

Every group gets a timeout, so a lost rank turns into an error the loop can report, not a
hang. `new_group` is collective: every rank creates these groups in the same order.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any


@dataclass
class SideGroups:
    probe: Any  # latency probes, on the sampler thread
    control: Any  # per-step summaries, shutdown agreement, on the training thread


SIDE_GROUP_TIMEOUT_S = 60.0


def side_group_timeout_s(training_timeout_s: float) -> float:
    """The side groups never wait longer than the training group would: a hung peer then
    costs the training thread (the actuator's gather) and the exit (probes still queued on
    the probe group end only by this timeout) no more than training's own collectives."""
    return min(SIDE_GROUP_TIMEOUT_S, training_timeout_s)


def default_group_timeout_s(fallback: float) -> float:
    """The timeout the default (training) group was created with, which the script may have
    set itself before `trainspec.init`; `fallback` where torch does not say."""
    import torch.distributed as dist

    from trainspec.kernels.hook_group import group_timeout_s

    world = dist.group.WORLD
    return fallback if world is None else group_timeout_s(world, fallback)


def create_side_groups(*, timeout_s: float = SIDE_GROUP_TIMEOUT_S) -> SideGroups | None:
    """Two gloo groups over all ranks, or None when not distributed."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size() < 2:
        return None
    timeout = timedelta(seconds=timeout_s)
    probe = dist.new_group(backend="gloo", timeout=timeout)
    control = dist.new_group(backend="gloo", timeout=timeout)
    return SideGroups(probe=probe, control=control)
