"""NVLink traffic per direction, from NVML's cumulative data counters.

NVML keeps, per GPU, running totals of the data each NVLink sent and received, in KiB
(`NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX` / `_RX`, read through `nvmlDeviceGetFieldValues`).
The field's scope is the link; scope UINT_MAX asks for the sum over all links (nvml.h, "NVLink
throughput counters field values"). pynvml sets the scope only when a field is given as a
`(field id, scope)` tuple: a bare id reads link 0 alone. A driver that refuses the aggregate
scope is read link by link and summed. Each read is differenced against the previous one over
the driver's own timestamps, so the first read of a GPU gives no rate, and a counter that went
backwards (driver reload) starts over rather than reporting a negative rate.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

ALL_LINKS = 0xFFFFFFFF  # UINT_MAX: the sum over every link
_FIELDS = (
    ("transmit", "NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX"),
    ("receive", "NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX"),
)


class NvlinkCounters:
    """One GPU's NVLink data counters, turned into bytes per second per direction."""

    def __init__(self, nvml: Any, handle: Any) -> None:
        self._nv = nvml
        self._handle = handle
        self._ids = [getattr(nvml, name) for _, name in _FIELDS]  # AttributeError: old bindings
        self._scopes: Sequence[int] | None = None  # decided on the first read
        self._last: tuple[float, list[int]] | None = None  # (seconds, KiB per direction)

    def read(self) -> list[tuple[str, float]]:
        """[(direction, bytes per second)] since the previous read; [] on the first.

        Raises NVMLError when the GPU has no readable NVLink counter (no NVLink, or a driver
        without the fields): the caller stops asking.
        """
        if self._scopes is None:
            self._scopes = self._choose_scopes()
        seconds, totals = self._totals(self._scopes)
        last, self._last = self._last, (seconds, totals)
        if last is None:
            return []
        elapsed = seconds - last[0]
        if elapsed <= 0 or any(now < before for now, before in zip(totals, last[1], strict=True)):
            return []  # no time passed, or a counter was reset: the next read starts over
        return [
            (direction, (now - before) * 1024.0 / elapsed)
            for (direction, _), now, before in zip(_FIELDS, totals, last[1], strict=True)
        ]

    def _choose_scopes(self) -> Sequence[int]:
        """The aggregate scope where the driver takes it, else every link that answers."""
        if self._try((ALL_LINKS,)):
            return (ALL_LINKS,)
        links = getattr(self._nv, "NVML_NVLINK_MAX_LINKS", 18)
        answering = [link for link in range(links) if self._try((link,))]
        if not answering:
            raise self._nv.NVMLError(getattr(self._nv, "NVML_ERROR_NOT_SUPPORTED", 3))
        return answering

    def _try(self, scopes: Sequence[int]) -> bool:
        try:
            self._totals(scopes)
        except self._nv.NVMLError:
            return False
        return True

    def _totals(self, scopes: Sequence[int]) -> tuple[float, list[int]]:
        """(driver timestamp in seconds, KiB per direction summed over `scopes`)."""
        request = [(field, scope) for scope in scopes for field in self._ids]
        values = self._nv.nvmlDeviceGetFieldValues(self._handle, request)
        totals = [0] * len(self._ids)
        stamp = 0
        for i, value in enumerate(values):
            if value.nvmlReturn != self._nv.NVML_SUCCESS:
                raise self._nv.NVMLError(value.nvmlReturn)
            totals[i % len(self._ids)] += int(value.value.ullVal)
            stamp = max(stamp, int(value.timestamp))
        # The driver stamps each value in microseconds; without a stamp, this host's clock.
        return (stamp / 1e6 if stamp > 0 else time.monotonic()), totals
