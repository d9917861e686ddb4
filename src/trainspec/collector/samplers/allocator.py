"""torch.cuda caching-allocator statistics: the memory-pressure family on GPUs."""

from __future__ import annotations

from trainspec.collector.records import Reading, attrs_json
from trainspec.collector.sampler import Sampler


class AllocatorSampler(Sampler):
    """Allocated, reserved, fragmentation (inactive split / reserved), retries, OOMs, pressure.

    `memory_stats()` reads host-side counters of the allocator: no device sync, cheap.
    """

    name = "allocator"

    def __init__(self, device_index: int, *, interval_s: float = 0.05) -> None:
        self.device_index = device_index
        self.interval_s = interval_s
        self._attrs = attrs_json({"gpu.index": device_index})
        self._limit: float | None = None

    def unavailable_reason(self) -> str | None:
        try:
            import torch
        except ImportError:
            return "torch is not installed"
        if not torch.cuda.is_available():
            return "no CUDA device (training on CPU: host memory is the pressure source)"
        self._limit = float(torch.cuda.get_device_properties(self.device_index).total_memory)
        return None

    def sample(self, now: float) -> list[Reading]:
        import torch

        s = torch.cuda.memory_stats(self.device_index)
        reserved = float(s.get("reserved_bytes.all.current", 0))
        inactive = float(s.get("inactive_split_bytes.all.current", 0))
        a = self._attrs
        out: list[Reading] = [
            (
                "trainspec.memory.allocator.allocated",
                float(s.get("allocated_bytes.all.current", 0)),
                a,
            ),
            ("trainspec.memory.allocator.reserved", reserved, a),
            (
                "trainspec.memory.allocator.fragmentation",
                inactive / reserved if reserved else 0.0,
                a,
            ),
            ("trainspec.memory.allocator.alloc_retries", float(s.get("num_alloc_retries", 0)), a),
            ("trainspec.memory.allocator.ooms", float(s.get("num_ooms", 0)), a),
        ]
        if self._limit:
            out.append(("trainspec.memory.pressure", min(reserved / self._limit, 1.0), a))
        return out
