"""Which rank owns which of the node's GPUs, so each GPU's readings go to its own job.

A rank's GPU is CUDA ordinal `local_rank` (torchrun's convention, `cuda:LOCAL_RANK`) among
the devices its process sees. What it sees the rank's sink reports with every batch
(`X-Trainspec-Cuda-Visible-Devices`, `X-Trainspec-Nvidia-Visible-Devices`, each sent only
when set): CUDA_VISIBLE_DEVICES entries are indices or GPU UUIDs (`GPU-...`, a unique
prefix is enough, as CUDA takes it), read as CUDA reads them (up to the first entry that is
neither); an index there counts among the container's GPUs when NVIDIA_VISIBLE_DEVICES
(the container runtime's and the Kubernetes device plugin's, usually UUIDs) names them,
in bus order (NVML's index order), as CUDA numbers a container's GPUs whatever the order of
the list (mixed GPU models under CUDA_DEVICE_ORDER=FASTEST_FIRST may differ). So job B on
GPUs 2,3 (CUDA_VISIBLE_DEVICES=2,3, local ranks 0,1) owns GPUs 2 and 3, not job A's 0 and 1
(found 2026-11-27: both jobs stored GPUs 0 and 1, and GPUs 2 and 3 were stored nowhere).

A rank that reports nothing is assumed to own GPU index == local rank (every GPU visible:
the documented default), but only while no other rank claims that GPU: an assumed claim
that collides with any other is dropped, and said once, rather than store another job's
readings. Two reported claims on one GPU (shared on purpose) both get its readings. A rank
whose report cannot name one GPU (a local rank past its visible list, a MIG instance, a
UUID this node does not have) gets none, said once. A `runs` row with device `cpu` owns no
GPU. Only ranks that sent a batch within `ACTIVE_S` own GPUs: a finished job's do not.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from dataclasses import dataclass

import pyarrow as pa

log = logging.getLogger("trainspec.agent")
ACTIVE_S = 30.0  # a rank with no batch for this long owns no GPU (its job ended)
_GPU = "trainspec.gpu."
MAX_VISIBLE_CHARS = 4096
_NO_CONSTRAINT = {"", "all"}  # NVIDIA_VISIBLE_DEVICES values that restrict nothing
_NO_GPU = {"none", "void"}

RankKey = tuple[str, int]  # (run id, rank)


@dataclass
class RankDevices:
    """What a rank told the agent about its devices."""

    local_rank: int | None = None
    device: str | None = None  # the runs row's: "cuda", "cpu"
    cuda_visible: str | None = None  # None: not reported (unset)
    nvidia_visible: str | None = None
    last_seen: float = 0.0  # time.monotonic() of its last batch

    @property
    def reported(self) -> bool:
        return self.cuda_visible is not None or (
            self.nvidia_visible is not None
            and self.nvidia_visible.strip().lower() not in _NO_CONSTRAINT
        )


def visible_entries(value: str) -> list[str]:
    """CUDA_VISIBLE_DEVICES as CUDA reads it: comma-separated indices or `GPU-`/`MIG-`
    UUIDs, up to the first entry that is neither."""
    out = []
    for entry in value.split(","):
        entry = entry.strip()
        if not (entry.isdigit() or entry.startswith(("GPU-", "MIG-"))):
            break
        out.append(entry)
    return out


def gpu_index(dev: RankDevices, index_of: dict[str, int]) -> int | None:
    """The node's index of the rank's GPU (`index_of`: index and UUID as the node's readings
    carry them -> index); None when it has none. ValueError saying why when its report
    names no single GPU of this node."""
    if dev.device == "cpu" or dev.local_rank is None:
        return None
    nvidia = (dev.nvidia_visible or "").strip()
    if nvidia.lower() in _NO_GPU:
        return None
    ref = str(dev.local_rank)
    if dev.cuda_visible is not None:  # CUDA keeps this list's order: cuda:0 is its first
        cuda = visible_entries(dev.cuda_visible)
        if dev.local_rank >= len(cuda):
            raise ValueError(
                f"local rank {dev.local_rank} but CUDA_VISIBLE_DEVICES names {len(cuda)} device(s)"
            )
        ref = cuda[dev.local_rank]
    if ref.isdigit() and nvidia.lower() not in _NO_CONSTRAINT:
        # The container's GPUs, which CUDA numbers in bus order as NVML does, whatever the
        # order of the list (the device plugin's UUIDs).
        container = [_resolve(e, index_of) for e in visible_entries(nvidia)]
        if None in container or int(ref) >= len(container):
            raise ValueError(f"device {ref} of NVIDIA_VISIBLE_DEVICES {nvidia!r} is not one "
                             "GPU of this node")  # fmt: skip
        return sorted(i for i in container if i is not None)[int(ref)]
    if ref.startswith("MIG-"):
        raise ValueError("a MIG instance: its GPU's readings are not its own")
    index = _resolve(ref, index_of)
    if index is None:
        raise ValueError(f"GPU {ref} is not among this node's GPUs")
    return index


class GpuOwners:
    """The ranks' device reports (request threads write) and the GPU -> owners mapping for
    each node batch (the node thread reads)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._ranks: dict[RankKey, RankDevices] = {}
        self._warned: set[tuple[RankKey, str]] = set()

    def saw_batch(
        self, run_id: str, rank: int, cuda_visible: str | None, nvidia_visible: str | None
    ) -> None:
        """A raw batch from the rank, with its visible devices as it reported them (None:
        not reported)."""
        with self._lock:
            dev = self._ranks.setdefault((run_id, rank), RankDevices())
            dev.cuda_visible = _header(cuda_visible)
            dev.nvidia_visible = _header(nvidia_visible)
            dev.last_seen = time.monotonic()

    def saw_run_row(
        self, run_id: str, rank: int, local_rank: int | None, device: str | None
    ) -> None:
        with self._lock:
            dev = self._ranks.setdefault((run_id, rank), RankDevices())
            if local_rank is not None:
                dev.local_rank = local_rank
            if device:
                dev.device = device.split(":")[0]

    def unknown_local(self, now: float | None = None) -> dict[str, set[int]]:
        """Active ranks whose local rank is not known, by run (to be read from the store)."""
        now = time.monotonic() if now is None else now
        out: dict[str, set[int]] = {}
        with self._lock:
            for (run, rank), dev in self._ranks.items():
                if dev.local_rank is None and now - dev.last_seen <= ACTIVE_S:
                    out.setdefault(run, set()).add(rank)
        return out

    def learn_local(self, run_id: str, found: dict[int, int]) -> None:
        """Local rank -> rank read from the store; a row this agent received wins."""
        with self._lock:
            for local_rank, rank in found.items():
                dev = self._ranks.get((run_id, rank))
                if dev is not None and dev.local_rank is None:
                    dev.local_rank = local_rank

    def owners(self, samples: pa.Table) -> dict[int, list[RankKey]]:
        """GPU index (as the node's readings carry it) -> the ranks owning it."""
        index_of = _gpu_ids(samples)
        if not index_of:
            return {}
        now = time.monotonic()
        claims: dict[int, list[tuple[RankKey, bool]]] = {}
        with self._lock:
            active = [(k, d) for k, d in self._ranks.items() if now - d.last_seen <= ACTIVE_S]
        for key, dev in sorted(active):
            try:
                index = gpu_index(dev, index_of)
            except ValueError as exc:
                self._warn(key, f"{exc}")
                continue
            if index is None:
                continue
            claims.setdefault(index, []).append((key, dev.reported))
        out: dict[int, list[RankKey]] = {}
        for index, claimants in claims.items():
            if len(claimants) == 1:
                out[index] = [claimants[0][0]]
                continue
            for key, reported in claimants:
                if not reported:
                    others = ", ".join(f"{r} rank {k}" for (r, k), _ in claimants if (r, k) != key)
                    self._warn(key, f"it reported no visible devices, and GPU {index}, "
                               f"assumed from its local rank, is claimed by {others} too")  # fmt: skip
            kept = [key for key, reported in claimants if reported]
            if kept:
                out[index] = kept
        return out

    def split(self, samples: pa.Table) -> tuple[dict[RankKey, pa.Table], pa.Table]:
        """The node's GPU readings as their owners' rows (`rank` set), by (run, rank), and
        the rest of the batch (host readings, GPUs no rank owns)."""
        owners = self.owners(samples)
        if not owners:
            return {}, samples
        metric = samples["metric"].to_pylist()
        attrs = samples["attrs"].to_pylist()
        rows: dict[RankKey, list[int]] = {}
        rest: list[int] = []
        for i, (m, a) in enumerate(zip(metric, attrs)):
            owned = owners.get(json.loads(a).get("gpu.index")) if m.startswith(_GPU) else None
            if not owned:
                rest.append(i)
            for key in owned or ():
                rows.setdefault(key, []).append(i)
        out = {}
        for (run, rank), take in rows.items():
            part = samples.take(pa.array(take, pa.int64()))
            ranks = pa.array([rank] * part.num_rows, pa.int32())
            out[(run, rank)] = part.set_column(part.schema.get_field_index("rank"), "rank", ranks)
        return out, samples.take(pa.array(rest, pa.int64()))

    def _warn(self, key: RankKey, why: str) -> None:
        with self._lock:
            if (key, why) in self._warned:
                return
            self._warned.add((key, why))
        log.warning("trainspec-agent: run %s rank %d: its GPU readings are not stored: %s "
                    "(set CUDA_VISIBLE_DEVICES for each job)", key[0], key[1], why)  # fmt: skip


def _header(value: str | None) -> str | None:
    if value is None or len(value) > MAX_VISIBLE_CHARS:
        return None
    return value


def _gpu_ids(samples: pa.Table) -> dict[str, int]:
    """The GPUs a node batch holds: index and UUID (`hw.id`) -> index."""
    out: dict[str, int] = {}
    seen: set[str] = set()
    for m, a in zip(samples["metric"].to_pylist(), samples["attrs"].to_pylist()):
        if not m.startswith(_GPU) or a in seen:
            continue
        seen.add(a)
        d = json.loads(a)
        index = d.get("gpu.index")
        if isinstance(index, int):
            out[str(index)] = index
            if isinstance(d.get("hw.id"), str):
                out[d["hw.id"]] = index
    return out


def _resolve(ref: str, index_of: dict[str, int]) -> int | None:
    """An index or a (unique prefix of a) UUID as the node's GPU index."""
    if ref.isdigit():
        return index_of.get(ref)
    found = {i for uuid, i in index_of.items() if uuid.startswith(ref)}  # a unique prefix
    return found.pop() if len(found) == 1 else None
