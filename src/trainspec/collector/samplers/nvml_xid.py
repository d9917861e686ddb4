"""Critical Xid errors through NVML's event API: one event set per GPU, drained without
waiting on each slow tick. Counts start at 0 when the sampler starts (NVML keeps no history
of Xid events, only delivers those that happen while a set is registered)."""

from __future__ import annotations

import contextlib
import logging
from typing import Any

log = logging.getLogger("trainspec.collector")
_MAX_PER_DRAIN = 64  # a storm of events must not hold the sampling thread
# Critical Xids that report an application's fault or its cleanup, not the GPU's health
# (NVIDIA's Xid catalogue: 43 "GPU stopped processing", a user program's fault; 45
# "preemptive cleanup" after a process was killed or an earlier error): not counted.
NOT_HARDWARE = frozenset({43, 45})


class XidEvents:
    def __init__(self, nvml: Any, handles: list[Any]) -> None:
        self._nv = nvml
        self._sets: dict[int, Any] = {}  # GPU position -> event set
        self.counts: dict[int, int] = {}
        self.last_xid: dict[int, int] = {}
        kind = nvml.nvmlEventTypeXidCriticalError
        for gpu, handle in enumerate(handles):
            event_set = None
            try:
                event_set = nvml.nvmlEventSetCreate()
                nvml.nvmlDeviceRegisterEvents(handle, kind, event_set)
            except (nvml.NVMLError, AttributeError) as exc:
                log.info("trainspec: NVML Xid events not supported on GPU %d: %s", gpu, exc)
                if event_set is not None:
                    with contextlib.suppress(nvml.NVMLError):
                        nvml.nvmlEventSetFree(event_set)
                continue
            self._sets[gpu] = event_set
            self.counts[gpu] = 0

    def drain(self) -> None:
        """Count the critical Xid events delivered since the last call; never waits."""
        nv = self._nv
        for gpu, event_set in list(self._sets.items()):
            for _ in range(_MAX_PER_DRAIN):
                try:
                    data = nv.nvmlEventSetWait_v2(event_set, 0)
                except nv.NVMLError as exc:
                    if getattr(exc, "value", None) != nv.NVML_ERROR_TIMEOUT:
                        # Not "nothing new": the GPU or the call is gone. Said once; the
                        # count is no longer reported, as it would no longer be true.
                        log.warning("trainspec: NVML Xid events on GPU %d stop: %s", gpu, exc)
                        del self._sets[gpu], self.counts[gpu]
                        with contextlib.suppress(nv.NVMLError):
                            nv.nvmlEventSetFree(event_set)
                    break
                except AttributeError as exc:  # bindings without the _v2 call
                    log.warning("trainspec: NVML Xid events on GPU %d stop: %s", gpu, exc)
                    del self._sets[gpu], self.counts[gpu]
                    break
                xid = int(data.eventData)
                if data.eventType & nv.nvmlEventTypeXidCriticalError and xid not in NOT_HARDWARE:
                    self.counts[gpu] += 1
                    self.last_xid[gpu] = xid
                    log.warning("trainspec: GPU %d reported critical Xid %d", gpu, xid)

    def close(self) -> None:
        for event_set in self._sets.values():
            with contextlib.suppress(self._nv.NVMLError):
                self._nv.nvmlEventSetFree(event_set)
        self._sets = {}
