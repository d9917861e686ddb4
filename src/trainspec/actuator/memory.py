"""Memory pressure: reserved against the limit, allocator retries.

The detector only reports; the memory policy (memory_policy.py) acts on it by shrinking the
micro-batch.

CUDA: the caching allocator's reserved bytes over the device's total, and `num_alloc_retries`
(a retry means the allocator had to free its cache to satisfy a request: the step before an
OOM). CPU: the host's used fraction (psutil), with no retry counter.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from trainspec.actuator.findings import Finding
from trainspec.actuator.state_fields import read_bool
from trainspec.actuator.summary import RankSummary
from trainspec.actuator.windowed import Latch


def read_memory(device: Any = None) -> tuple[float, float]:
    """(pressure 0..1, allocator retries so far) for this rank's device; (0, 0) if unknown."""
    try:
        import torch

        if device is not None and getattr(device, "type", None) == "cuda":
            total = torch.cuda.get_device_properties(device).total_memory
            stats = torch.cuda.memory_stats(device)
            reserved = stats.get("reserved_bytes.all.current", 0)
            return reserved / total, float(stats.get("num_alloc_retries", 0))
        import psutil

        return psutil.virtual_memory().percent / 100.0, 0.0
    except Exception:  # a probe that fails reports nothing rather than stopping the loop
        return 0.0, 0.0


def memory_capacity(device: Any = None) -> float:
    """Bytes the pressure is a fraction of: the device's total (CUDA) or the host's; 0 if unknown."""
    try:
        import torch

        if device is not None and getattr(device, "type", None) == "cuda":
            return float(torch.cuda.get_device_properties(device).total_memory)
        import psutil

        return float(psutil.virtual_memory().total)
    except Exception:  # as read_memory: unknown rather than failing
        return 0.0


@dataclass
class MemoryPressureDetector:
    enter: float = 0.92
    exit: float = 0.85
    patience: int = 2
    latch: Latch = field(default_factory=Latch)
    _retries: dict[int, float] = field(default_factory=dict)
    pressed: bool = False  # the last window's raw reading was over the threshold (or retried)

    @property
    def active(self) -> bool:
        return self.latch.active

    def __post_init__(self) -> None:
        self.latch.patience = self.patience

    def state_dict(self) -> dict[str, Any]:
        """The latch and the last reading; not the allocator retry counts (a new process
        starts its own)."""
        return {**self.latch.state_dict(), "pressed": self.pressed}

    def load_state_dict(self, state: Any) -> None:
        """Missing keys keep their value; raises StateError naming a bad one."""
        pressed = read_bool(state, "pressed", self.pressed)
        self.latch.load_state_dict(state)
        self.pressed = pressed

    def observe(self, summaries: list[RankSummary]) -> list[Finding]:
        worst = max(summaries, key=lambda s: s.memory_pressure)
        new_retries = [
            s.rank for s in summaries if s.alloc_retries > self._retries.get(s.rank, 0.0)
        ]
        self._retries = {s.rank: s.alloc_retries for s in summaries}
        pressed = worst.memory_pressure > self.enter or bool(new_retries)
        self.pressed = pressed
        change = self.latch.update(pressed, worst.memory_pressure < self.exit and not new_retries)
        if change is None:
            return []
        return [
            Finding(
                "memory_pressure",
                f"memory pressure {'high' if change == 'enter' else 'eased'}: "
                f"{worst.memory_pressure:.0%} reserved on rank {worst.rank}"
                + (f", allocator retries on {new_retries}" if new_retries else ""),
                ranks=(worst.rank, *new_retries),
                evidence={"pressure": [round(s.memory_pressure, 4) for s in summaries]},
                cleared=change == "exit",
            )
        ]
