"""GPU hardware through NVML (nvidia-ml-py): only the job's own GPUs, at their true resolution.

Utilization is averaged by the driver over 1/6 s to 1 s, so it is read every 200 ms, not
every tick; memory and instantaneous power are read every tick (50 ms); slow-changing or
cumulative fields (energy, temperature, clocks, errors, PCIe, NVLink) once a second. Critical
Xid errors arrive through NVML's event API (nvml_xid.py), counted from the sampler's start;
NVLink traffic is the difference of NVML's running totals between reads (nvlink.py).
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from trainspec.collector.records import Reading, attrs_json
from trainspec.collector.sampler import Sampler
from trainspec.collector.samplers.nvlink import NvlinkCounters
from trainspec.collector.samplers.nvml_fields import field_number
from trainspec.collector.samplers.nvml_xid import XidEvents

log = logging.getLogger("trainspec.collector")

_UTIL_EVERY = 4  # 200 ms at a 50 ms tick (the driver averages over at least 1/6 s)
_SLOW_EVERY = 10  # 0.5 s, for fields required each second (room for a stalled tick)


@dataclass(frozen=True)
class GpuInfo:
    index: int
    uuid: str
    name: str
    memory_total: int


def visible_nvml_indices(
    local_rank: int | None, environ: dict[str, str] | None = None
) -> list[str]:
    """The NVML device ids (index strings or UUIDs) this process may use.

    With a local rank: the one GPU torch calls `cuda:local_rank`, through CUDA_VISIBLE_DEVICES.
    Without (the node agent): every visible GPU, or all when the variable is unset ("*").
    """
    env = os.environ if environ is None else environ
    visible = env.get("CUDA_VISIBLE_DEVICES")
    ids = [v.strip() for v in visible.split(",") if v.strip()] if visible is not None else None
    if local_rank is None:
        return ids if ids is not None else ["*"]
    if ids is None:
        return [str(local_rank)]
    if local_rank >= len(ids):
        raise ValueError(f"local rank {local_rank} but CUDA_VISIBLE_DEVICES lists {len(ids)} GPUs")
    return [ids[local_rank]]


class NvmlSampler(Sampler):
    """Samples a set of GPUs. Unavailable, once and clearly, with no driver or no GPU."""

    name = "nvml"

    def __init__(self, device_ids: Sequence[str], *, interval_s: float = 0.05) -> None:
        self.device_ids = list(device_ids)
        self.interval_s = interval_s
        self._nvml: Any = None
        self._handles: list[tuple[Any, str]] = []  # (handle, attrs json)
        self.gpus: list[GpuInfo] = []
        self._unsupported: set[tuple[int, str]] = set()
        self._xid: XidEvents | None = None
        self._nvlink: dict[int, NvlinkCounters] = {}
        self._n = 0

    def unavailable_reason(self) -> str | None:
        try:
            import pynvml
        except ImportError:
            return "nvidia-ml-py is not installed (pip install 'trainspec[nvml]')"
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError as exc:
            return f"NVML cannot start: {exc} (no NVIDIA driver or no GPU)"
        self._nvml = pynvml
        try:
            ids = self.device_ids
            if ids == ["*"]:
                ids = [str(i) for i in range(pynvml.nvmlDeviceGetCount())]
            if not ids:
                return "no GPU visible to this process"
            for dev in ids:
                if dev.startswith(("GPU-", "MIG-")):
                    handle = pynvml.nvmlDeviceGetHandleByUUID(dev)
                else:
                    handle = pynvml.nvmlDeviceGetHandleByIndex(int(dev))
                index = pynvml.nvmlDeviceGetIndex(handle)
                uuid = _text(pynvml.nvmlDeviceGetUUID(handle))
                info = GpuInfo(
                    index=index,
                    uuid=uuid,
                    name=_text(pynvml.nvmlDeviceGetName(handle)),
                    memory_total=int(pynvml.nvmlDeviceGetMemoryInfo(handle).total),
                )
                self.gpus.append(info)
                self._handles.append((handle, attrs_json({"gpu.index": index, "hw.id": uuid})))
        except (pynvml.NVMLError, ValueError) as exc:
            return f"NVML cannot open the job's GPUs {self.device_ids}: {exc}"
        self._xid = XidEvents(pynvml, [h for h, _ in self._handles])
        return None

    def _read(self, gpu: int, metric: str, fn: Callable[[], float]) -> float | None:
        """One NVML field; a field the device does not support is asked once, then skipped."""
        if (gpu, metric) in self._unsupported:
            return None
        try:
            return float(fn())
        except (self._nvml.NVMLError, AttributeError) as exc:
            self._unsupported.add((gpu, metric))
            log.info("trainspec: NVML %s not supported on GPU %d: %s", metric, gpu, exc)
            return None

    def sample(self, now: float) -> list[Reading]:
        nv = self._nvml
        out: list[Reading] = []
        util_tick = self._n % _UTIL_EVERY == 0
        slow_tick = self._n % _SLOW_EVERY == 0
        self._n += 1
        if slow_tick and self._xid is not None:
            self._xid.drain()
        for gpu, (h, a) in enumerate(self._handles):
            mem = nv.nvmlDeviceGetMemoryInfo(h)
            out.append(("trainspec.gpu.memory.used", float(mem.used), a))
            out.extend(self._power(gpu, h, a))
            if util_tick:
                rates = nv.nvmlDeviceGetUtilizationRates(h)
                out.append(("trainspec.gpu.utilization", rates.gpu / 100.0, a))
                out.append(("trainspec.gpu.memory.utilization", rates.memory / 100.0, a))
            if slow_tick:
                out.append(("trainspec.gpu.memory.limit", float(mem.total), a))
                out.extend(self._slow(gpu, h, a))
        return out

    def _power(self, gpu: int, h: Any, a: str) -> list[Reading]:
        nv = self._nvml
        instant = self._read(
            gpu, "power.instant", lambda: _field_value(nv, h, "NVML_FI_DEV_POWER_INSTANT")
        )
        if instant is not None:
            return [("trainspec.gpu.power", instant / 1000.0, _with(a, "instant"))]
        averaged = self._read(gpu, "power.average", lambda: nv.nvmlDeviceGetPowerUsage(h))
        return (
            []
            if averaged is None
            else [("trainspec.gpu.power", averaged / 1000.0, _with(a, "averaged"))]
        )

    def _slow(self, gpu: int, h: Any, a: str) -> list[Reading]:
        nv = self._nvml
        throttle = (
            getattr(nv, "nvmlDeviceGetCurrentClocksEventReasons", None)
            or nv.nvmlDeviceGetCurrentClocksThrottleReasons
        )
        fields: list[tuple[str, Callable[[], float], float]] = [
            ("trainspec.gpu.energy", lambda: nv.nvmlDeviceGetTotalEnergyConsumption(h), 1e-3),
            (
                "trainspec.gpu.temperature",
                lambda: nv.nvmlDeviceGetTemperature(h, nv.NVML_TEMPERATURE_GPU),
                1.0,
            ),
            ("trainspec.gpu.clock.sm", lambda: nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_SM), 1e6),
            ("trainspec.gpu.throttle_reasons", lambda: throttle(h), 1.0),
            (
                "trainspec.gpu.errors.ecc",
                lambda: nv.nvmlDeviceGetTotalEccErrors(
                    h, nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nv.NVML_VOLATILE_ECC
                ),
                1.0,
            ),
            (
                "trainspec.gpu.errors.remapped_rows",
                lambda: sum(nv.nvmlDeviceGetRemappedRows(h)[:2]),
                1.0,
            ),
        ]
        out: list[Reading] = []
        for metric, fn, scale in fields:
            value = self._read(gpu, metric, fn)
            if value is not None:
                out.append((metric, value * scale, a))
        if self._xid is not None and gpu in self._xid.counts:
            out.append(("trainspec.gpu.errors.xid", float(self._xid.counts[gpu]), a))
        for direction, counter in (
            ("transmit", "NVML_PCIE_UTIL_TX_BYTES"),
            ("receive", "NVML_PCIE_UTIL_RX_BYTES"),
        ):
            kbps = self._read(
                gpu,
                f"pcie.{direction}",
                functools.partial(_pcie_kbps, nv, h, counter),
            )
            if kbps is not None:
                out.append(
                    ("trainspec.gpu.pcie.throughput", kbps * 1024.0, _with_direction(a, direction))
                )
        out.extend(self._nvlink_rates(gpu, h, a))
        return out

    def _nvlink_rates(self, gpu: int, h: Any, a: str) -> list[Reading]:
        """A GPU without active links or readable counters is asked once; a failed read
        later on only restarts the differencing (the next read gives no rate)."""
        if (gpu, "nvlink") in self._unsupported:
            return []
        counters = self._nvlink.get(gpu)
        if counters is None:
            try:
                counters = self._nvlink[gpu] = NvlinkCounters(self._nvml, h)
            except (self._nvml.NVMLError, AttributeError) as exc:
                self._unsupported.add((gpu, "nvlink"))
                log.info("trainspec: no NVLink traffic to read on GPU %d: %s", gpu, exc)
                return []
        try:
            rates = counters.read()
        except self._nvml.NVMLError as exc:
            log.debug("trainspec: NVLink read failed on GPU %d: %s", gpu, exc)
            return []
        return [
            ("trainspec.gpu.nvlink.throughput", rate, _with_direction(a, direction))
            for direction, rate in rates
        ]

    def close(self) -> None:
        if self._xid is not None:
            self._xid.close()
        if self._nvml is not None:
            with contextlib.suppress(self._nvml.NVMLError):
                self._nvml.nvmlShutdown()


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _field_value(nv: Any, handle: Any, field_name: str) -> float:
    field_id = getattr(nv, field_name)  # AttributeError on old bindings: treated as unsupported
    (value,) = nv.nvmlDeviceGetFieldValues(handle, [field_id])
    return float(field_number(nv, value))


@functools.lru_cache(maxsize=256)
def _with(attrs: str, power_kind: str) -> str:
    d = json.loads(attrs)
    d["trainspec.power.kind"] = power_kind
    return attrs_json(d)


@functools.lru_cache(maxsize=256)
def _with_direction(attrs: str, direction: str) -> str:
    d = json.loads(attrs)
    d["direction"] = direction
    return attrs_json(d)


def _pcie_kbps(nv: Any, handle: Any, counter: str) -> float:
    """PCIe throughput in KB/s, one direction (`counter` names NVML's constant)."""
    return float(nv.nvmlDeviceGetPcieThroughput(handle, getattr(nv, counter)))
