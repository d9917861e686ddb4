"""Simulated device time: a forward and backward that wait, as a host waits on GPU kernels.

The straggler benchmark needs N ranks whose compute runs side by side. On a CPU machine with
fewer cores than ranks the real model's compute time-shares the cores, so the ranks' speeds
are the scheduler's, not the workload's. A sleep costs no CPU: with `--simulate-device-ms
FIXED,PER_SAMPLE` each micro-batch's forward waits FIXED + PER_SAMPLE x samples milliseconds
and then twice that for its backward (a backward costs about twice its forward), on top of a
real (small) model whose gradients DDP still all-reduces. Both waits happen in the forward call:
an autograd Function that slept in its backward left a Python object in a gloo work's
thread-local state, and a rank deadlocked at exit destroying it. So the store books the
backward's wait under forward: the sum, which the actuator uses, is right, the split is not,
and no bucket all-reduce overlaps the simulated backward. The control loop then sees what it would see on
a GPU job: compute time that scales with the share it is given, ranks that do not contend.
Only for benchmarks and tests; a real job never sets it.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

BACKWARD_TO_FORWARD = 2.0


@dataclass(frozen=True)
class SimulatedDevice:
    fixed_s: float
    per_sample_s: float

    @classmethod
    def parse(cls, text: str) -> SimulatedDevice:
        """'FIXED,PER_SAMPLE' in milliseconds of forward time, e.g. '1,0.5'."""
        parts = text.split(",")
        try:
            fixed, per_sample = (float(p) for p in parts)
        except ValueError:
            raise ValueError(
                f"--simulate-device-ms takes FIXED,PER_SAMPLE milliseconds, got {text!r}"
            ) from None
        if not (math.isfinite(fixed) and math.isfinite(per_sample)) or not (
            fixed >= 0 and per_sample > 0
        ):
            raise ValueError(f"--simulate-device-ms needs FIXED >= 0 and PER_SAMPLE > 0: {text!r}")
        return cls(fixed / 1e3, per_sample / 1e3)

    def forward_s(self, samples: int) -> float:
        return self.fixed_s + self.per_sample_s * samples

    def wait_forward(self, samples: int) -> None:
        time.sleep(self.forward_s(samples))

    def wait_backward(self, samples: int) -> None:
        time.sleep(BACKWARD_TO_FORWARD * self.forward_s(samples))
