"""The node's own readings, sampled once for every rank: GPUs through NVML, host CPU and memory.

The agent runs the collector's samplers (`NvmlSampler(["*"])`: every GPU the node shows,
`HostSampler` without per-process fields, which describe the agent, not a rank) on a
`Collector` of its own. Without a driver NVML says so once (logged and kept in the
inventory) and the agent serves host metrics alone. The inventory (GPU models, UUIDs, and
the NVLink/PCIe topology matrix NVML reports between each pair) goes into `/v1/status`,
the `trainspec_agent_*_info` series, and each run's `runs` row written by the agent.
"""

from __future__ import annotations

import logging
import socket
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq

from trainspec.collector import Batch, Collector, Sink
from trainspec.collector.records import Reading
from trainspec.collector.samplers.host import HostSampler
from trainspec.collector.samplers.nvml import NvmlSampler
from trainspec.store.layout import list_table_segments

log = logging.getLogger("trainspec.agent")
NODE_RANK = -1  # the node's own collector; its rows are re-ranked before the store


def local_ranks_in_store(run_dir: Path, ranks: Collection[int]) -> dict[int, int]:
    """Local rank -> rank from a run's `runs` rows on disk (every writer's segments: the
    agent's, and a rank's own written while no agent answered), for `ranks` only. Best
    effort: an unreadable segment is skipped, and a run with none gives {}."""
    found: dict[int, int] = {}
    try:
        segments = list_table_segments(run_dir, "runs")
    except OSError:
        return found
    for seg in segments:
        try:
            table = pq.read_table(seg.path, columns=["rank", "local_rank"])
        except Exception:  # merged away meanwhile, half written by a dying rank...
            continue
        for row in table.to_pylist():
            if row["rank"] in ranks and row["local_rank"] is not None:
                found[row["local_rank"]] = row["rank"]
    return found


def run_row_in_store(run_dir: Path, rank: int) -> dict[str, Any] | None:
    """One rank's `runs` row on disk (rank, local_rank, world_size), or None. Best effort,
    as `local_ranks_in_store`."""
    try:
        segments = list_table_segments(run_dir, "runs")
    except OSError:
        return None
    for seg in segments:
        try:
            table = pq.read_table(seg.path, columns=["rank", "local_rank", "world_size"])
        except Exception:  # merged away meanwhile, half written by a dying rank...
            continue
        for row in table.to_pylist():
            if row["rank"] == rank:
                return row
    return None


class NodeHostSampler(HostSampler):
    """Host CPU and memory; the process fields would describe the agent itself, so not sent."""

    name = "host"

    def sample(self, now: float) -> list[Reading]:
        return _node_only(super().sample(now))

    def closing_readings(self, now: float) -> list[Reading]:
        return _node_only(super().closing_readings(now))


def _node_only(readings: list[Reading]) -> list[Reading]:
    return [r for r in readings if not r[0].startswith("trainspec.process.")]


class _CallbackSink(Sink):
    name = "node"

    def __init__(self, on_batch: Callable[[Batch], None]) -> None:
        self.on_batch = on_batch

    def write(self, batch: Batch) -> None:
        self.on_batch(batch)


def topology(nvml: Any, handles: list[Any]) -> list[list[str]]:
    """Pairwise link between GPUs, as `nvidia-smi topo -m` names it (NVML common ancestor,
    and NV<n> where n NVLinks join the pair)."""
    names = {
        "NVML_TOPOLOGY_INTERNAL": "X",
        "NVML_TOPOLOGY_SINGLE": "PIX",
        "NVML_TOPOLOGY_MULTIPLE": "PXB",
        "NVML_TOPOLOGY_HOSTBRIDGE": "PHB",
        "NVML_TOPOLOGY_NODE": "NODE",
        "NVML_TOPOLOGY_SYSTEM": "SYS",
    }
    level = {getattr(nvml, k): v for k, v in names.items() if hasattr(nvml, k)}
    matrix: list[list[str]] = []
    for i, a in enumerate(handles):
        row = []
        for j, b in enumerate(handles):
            if i == j:
                row.append("X")
                continue
            links = _nvlinks_between(nvml, a, b)
            if links:
                row.append(f"NV{links}")
                continue
            try:
                row.append(level.get(nvml.nvmlDeviceGetTopologyCommonAncestor(a, b), "?"))
            except nvml.NVMLError:
                row.append("?")
        matrix.append(row)
    return matrix


def _nvlinks_between(nvml: Any, a: Any, b: Any) -> int:
    try:
        target = nvml.nvmlDeviceGetPciInfo(b).busId
    except nvml.NVMLError:
        return 0
    n = 0
    for link in range(getattr(nvml, "NVML_NVLINK_MAX_LINKS", 18)):
        try:
            if nvml.nvmlDeviceGetNvLinkState(a, link) != nvml.NVML_FEATURE_ENABLED:
                continue
            if nvml.nvmlDeviceGetNvLinkRemotePciInfo(a, link).busId == target:
                n += 1
        except nvml.NVMLError:
            break  # no NVLink on this device, or past its last link
    return n


class NodeSampler:
    """Runs the node's samplers and hands every batch to `on_batch` (store, /metrics)."""

    def __init__(
        self,
        on_batch: Callable[[Batch], None],
        *,
        interval_s: float = 0.05,
        flush_interval_s: float = 0.5,
        nvml: bool = True,
    ) -> None:
        samplers: list[Any] = [NodeHostSampler(interval_s=interval_s, memory_pressure=False)]
        self.nvml = NvmlSampler(["*"], interval_s=interval_s) if nvml else None
        if self.nvml is not None:
            samplers.append(self.nvml)
        self.collector = Collector(
            rank=NODE_RANK,
            samplers=samplers,
            sinks=[_CallbackSink(on_batch)],
            flush_interval_s=flush_interval_s,
        )
        self.inventory = self._inventory()

    def _inventory(self) -> dict[str, Any]:
        nvml_state = "off"
        gpus: list[dict[str, Any]] = []
        matrix: list[list[str]] = []
        if self.nvml is not None:
            reason = self.collector.unavailable.get("nvml")
            nvml_state = "unavailable" if reason else "ok"
            if reason:
                log.warning("trainspec-agent: NVML unavailable, serving host metrics: %s", reason)
            else:
                gpus = [vars(g) for g in self.nvml.gpus]
                handles = [h for h, _ in self.nvml._handles]
                matrix = topology(self.nvml._nvml, handles)
        return {
            "host": socket.gethostname(),
            "nvml": nvml_state,
            "nvml_reason": self.collector.unavailable.get("nvml", ""),
            "gpus": gpus,
            "topology": matrix,
        }

    def start(self) -> NodeSampler:
        self.collector.start()
        return self

    def close(self, *, timeout_s: float = 5.0) -> None:
        self.collector.close(timeout_s=timeout_s)
