"""NVLink traffic per direction, from NVML's cumulative data counters.

NVML keeps, per GPU, running totals of the data each NVLink sent and received, in KiB
(`NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX` / `_RX`, read through `nvmlDeviceGetFieldValues`).
The field's scope is the link; scope UINT_MAX asks for the sum over all links (nvml.h, "NVLink
throughput counters field values"). pynvml sets the scope only when a field is given as a
`(field id, scope)` tuple: a bare id reads link 0 alone. A GPU with no active link
(`nvmlDeviceGetNvLinkState`) has no NVLink traffic to report: it is left out rather than
reported as zero. A driver that refuses the aggregate scope is read link by link.

Each read is differenced against the previous one over the driver's own timestamps, so the
first read gives no rate; a counter that went backwards (driver reload, a link reset) or a
change of clock (a read without a driver timestamp falls back to this host's monotonic
clock) starts over instead of reporting a negative or near-zero rate.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from trainspec.collector.samplers.nvml_fields import field_number

ALL_LINKS = 0xFFFFFFFF  # UINT_MAX: the sum over every link
_FIELDS = (
    ("transmit", "NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX"),
    ("receive", "NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX"),
)


class NvlinkCounters:
    """One GPU's NVLink data counters, turned into bytes per second per direction.

    The constructor raises NVMLError when the GPU has no active link or no readable counter
    (the caller stops asking); `read` raises NVMLError on a failed read (the caller may ask
    again: the next read starts over).
    """

    def __init__(self, nvml: Any, handle: Any) -> None:
        self._nv = nvml
        self._handle = handle
        self._ids = [getattr(nvml, name) for _, name in _FIELDS]  # AttributeError: old bindings
        self._scopes = self._choose_scopes(self._active_links())
        self._last: tuple[str, float, list[int]] | None = None  # (clock, seconds, totals)

    def read(self) -> list[tuple[str, float]]:
        """[(direction, bytes per second)] since the previous read; [] when starting over."""
        try:
            clock, seconds, totals = self._totals(self._scopes)
        except self._nv.NVMLError:
            self._last = None
            raise
        last, self._last = self._last, (clock, seconds, totals)
        if last is None or last[0] != clock:
            return []
        elapsed = seconds - last[1]
        if elapsed <= 0 or any(now < before for now, before in zip(totals, last[2], strict=True)):
            return []  # no time passed, or a counter was reset: the next read starts over
        n = len(self._ids)  # totals are per scope, then per direction: direction i is [i::n]
        return [
            (direction, (sum(totals[i::n]) - sum(last[2][i::n])) * 1024.0 / elapsed)
            for i, (direction, _) in enumerate(_FIELDS)
        ]

    def _active_links(self) -> list[int]:
        """Links in the enabled state; NVML answers an error past the device's last link."""
        enabled = getattr(self._nv, "NVML_FEATURE_ENABLED", 1)
        links = getattr(self._nv, "NVML_NVLINK_MAX_LINKS", 18)
        active = []
        for link in range(links):
            try:
                if self._nv.nvmlDeviceGetNvLinkState(self._handle, link) == enabled:
                    active.append(link)
            except self._nv.NVMLError:
                break  # no NVLink on this device, or past its last link
        if not active:
            raise self._nv.NVMLError(getattr(self._nv, "NVML_ERROR_NOT_SUPPORTED", 3))
        return active

    def _choose_scopes(self, active: Sequence[int]) -> Sequence[int]:
        """The aggregate scope where the driver takes it, else the active links one by one."""
        for scopes in ((ALL_LINKS,), tuple(active)):
            try:
                self._totals(scopes)
            except self._nv.NVMLError:
                continue
            return scopes
        raise self._nv.NVMLError(getattr(self._nv, "NVML_ERROR_NOT_SUPPORTED", 3))

    def _totals(self, scopes: Sequence[int]) -> tuple[str, float, list[int]]:
        """(clock, seconds, KiB per scope and direction: scope-major, direction-minor)."""
        request = [(field, scope) for scope in scopes for field in self._ids]
        values = self._nv.nvmlDeviceGetFieldValues(self._handle, request)
        totals = []
        stamp = 0
        for value in values:
            totals.append(int(field_number(self._nv, value)))
            stamp = max(stamp, int(value.timestamp))
        # The driver stamps each value in microseconds; without a stamp, this host's clock.
        if stamp > 0:
            return "driver", stamp / 1e6, totals
        return "host", time.monotonic(), totals
