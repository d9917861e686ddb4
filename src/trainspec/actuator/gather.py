"""Moving the window summaries between ranks: one all-gather on the control group.

Every rank runs the same deterministic decision on the same gathered vectors, so no second
round (rank 0 deciding, then broadcasting) is needed: one collective instead of two, and
every rank holds the evidence behind its own events. Determinism holds because the inputs
are bit-identical float64 vectors and the policies are pure functions of them and of state
that evolved from the same inputs.
"""

from __future__ import annotations

from typing import Any

from trainspec.actuator.summary import RankSummary


class GatherError(RuntimeError):
    """The control-plane collective failed or timed out; the window's decision is void."""


def gather_summaries(summary: RankSummary, group: Any) -> list[RankSummary]:
    """Every rank's summary, in rank order. Raises GatherError on any collective failure.

    The group's own timeout (set when it was created) bounds the wait.
    """
    import torch
    import torch.distributed as dist

    try:
        world = dist.get_world_size(group)
        mine = torch.tensor(summary.to_list(), dtype=torch.float64)
        out = [torch.empty_like(mine) for _ in range(world)]
        dist.all_gather(out, mine, group=group)
    except Exception as exc:  # gloo raises RuntimeError subclasses (timeouts, lost peers)
        raise GatherError(f"control all-gather failed: {exc}") from exc
    return [RankSummary.from_list(t.tolist()) for t in out]
