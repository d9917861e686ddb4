"""The latency probe's readings, as the actuator sees them: a collector tap keeps this
window's readings and the controller takes their median when it closes a window.

`TRAINSPEC_INJECT` may stage a spike: `latency:rank=R,step=S,ms=M` adds M milliseconds to
the readings rank R's controller sees from step S on, as a congested link would; what the
store and the exporters get is the real reading (runtime/inject.py).
"""

from __future__ import annotations

import math
import statistics
import threading
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

from trainspec.collector.records import Reading
from trainspec.collector.samplers.latency import METRIC
from trainspec.runtime.inject import Injector


class ProbeLatencyWindow:
    """Readings of `trainspec.comm.probe.latency` since the last `take` (sampling thread in,
    training thread out); at most `capacity` of the newest are kept, so a window the
    controller skips (paused, stopped) cannot grow it."""

    def __init__(self, added_s: Callable[[], float] = lambda: 0.0, capacity: int = 1024) -> None:
        self._added_s = added_s
        self._lock = threading.Lock()
        self._values: deque[float] = deque(maxlen=capacity)

    def observe(self, readings: Sequence[Reading]) -> None:
        values = [float(r[1]) for r in readings if r[0] == METRIC]
        if values:
            extra = self._added_s()
            with self._lock:
                self._values.extend(v + extra for v in values)

    def take(self) -> float:
        """Median of the window's readings; NaN when the probe delivered none."""
        with self._lock:
            values = list(self._values)
            self._values.clear()
        return statistics.median(values) if values else math.nan


def probe_window(session: Any, injector: Injector) -> ProbeLatencyWindow | None:
    """The window for this session (None without a collector: no probe readings to see).
    It sees readings once `session.collector.add_tap(window.observe)` is called."""
    if session.collector is None:
        return None

    def injected_s() -> float:
        return sum((f.ms or 0.0) for f in injector.active("latency", session.step_index)) / 1e3

    return ProbeLatencyWindow(injected_s)
