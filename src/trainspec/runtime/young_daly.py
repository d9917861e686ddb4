"""How often to checkpoint: the Young/Daly optimum from the measured cost and the failure rate.

Young (1974), "A first order approximation to the optimum checkpoint interval": the interval
that minimises expected lost work plus checkpoint overhead is sqrt(2 * C * M), for checkpoint
cost C and mean time between failures M. Daly (2006), "A higher order estimate of the optimum
checkpoint interval for restart dumps", refines it when C is not small against M. A job fails
when any of its GPUs does, so with independent failures the job's M is the per-GPU M over the
GPU count.
"""

from __future__ import annotations

import math


def job_mtbf_s(per_gpu_mtbf_s: float, gpu_count: int) -> float:
    """MTBF of a job on `gpu_count` GPUs that each fail independently at 1 / `per_gpu_mtbf_s`."""
    if per_gpu_mtbf_s <= 0:
        raise ValueError(f"per-GPU MTBF must be positive seconds, got {per_gpu_mtbf_s}")
    if gpu_count < 1:
        raise ValueError(f"GPU count must be at least 1, got {gpu_count}")
    return per_gpu_mtbf_s / gpu_count


def young_interval_s(cost_s: float, mtbf_s: float) -> float:
    """Young's optimum interval between checkpoints: sqrt(2 * cost * MTBF)."""
    _check(cost_s, mtbf_s)
    return math.sqrt(2.0 * cost_s * mtbf_s)


def daly_interval_s(cost_s: float, mtbf_s: float) -> float:
    """Daly's higher-order optimum (his eq. 37); equals MTBF once cost reaches 2 * MTBF."""
    _check(cost_s, mtbf_s)
    if cost_s >= 2.0 * mtbf_s:
        return mtbf_s
    ratio = cost_s / (2.0 * mtbf_s)
    return math.sqrt(2.0 * cost_s * mtbf_s) * (1.0 + math.sqrt(ratio) / 3.0 + ratio / 9.0) - cost_s


def interval_steps(
    cost_s: float, step_s: float, per_gpu_mtbf_s: float, gpu_count: int, *, min_steps: int = 1
) -> int:
    """Young's interval for a job, in whole training steps (at least `min_steps`)."""
    if step_s <= 0:
        raise ValueError(f"step time must be positive seconds, got {step_s}")
    interval = young_interval_s(cost_s, job_mtbf_s(per_gpu_mtbf_s, gpu_count))
    return max(min_steps, round(interval / step_s))


def _check(cost_s: float, mtbf_s: float) -> None:
    if cost_s < 0 or not math.isfinite(cost_s):
        raise ValueError(f"checkpoint cost must be finite non-negative seconds, got {cost_s}")
    if mtbf_s <= 0 or not math.isfinite(mtbf_s):
        raise ValueError(f"MTBF must be finite positive seconds, got {mtbf_s}")
