"""Atomic, priced checkpoints of a training job, and resuming from the newest good one.

The Checkpointer saves model and optimizer through torch.distributed.checkpoint (dcp), async
where torch offers it (`dcp.async_save`: the caller stalls only while state is staged to CPU),
and next to them what dcp does not hold: LR scheduler, RNG states (torch, python, numpy),
the batch sampler's position and an opaque JSON dict of trainspec's own state.

Every collective runs on the Checkpointer's own gloo group with a timeout, never the default
group: dcp.async_save's background collectives on the default group once deadlocked against
DDP's next all-reduce. A checkpoint counts only once rank 0 has written its COMMIT marker
after a barrier that every rank reaches when its data is on disk (see `checkpoint_layout`).
Loading takes the newest committed checkpoint that verifies on every rank, falling back to
the previous one (reported) for a corrupt or missing file, and raises a `CheckpointError`
rather than resume wrongly (another world size, nothing loadable). Each save's cost (stall,
duration, bytes) and each fallback are reported through `on_event(kind, reason, evidence)`,
with kind "checkpoint"; a callback that raises is logged and ignored.
"""

from __future__ import annotations

import json
import logging
import secrets
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from trainspec.runtime import checkpoint_layout as layout
from trainspec.runtime.checkpoint_layout import (
    CheckpointError,
    CorruptCheckpointError,
    WorldSizeMismatchError,
)
from trainspec.runtime.rng_state import capture_rng, restore_rng

__all__ = [
    "CheckpointError",
    "Checkpointer",
    "CorruptCheckpointError",
    "LoadedCheckpoint",
    "SaveRecord",
    "WorldSizeMismatchError",
]

log = logging.getLogger(__name__)
EventCallback = Callable[[str, str, dict], None]
EVENT_KIND = "checkpoint"


@dataclass(frozen=True)
class SaveRecord:
    step: int
    reason: str
    path: str
    stall_s: float  # time the training loop was blocked by this save
    wait_s: float  # part of the stall spent waiting for the previous save to commit
    stage_s: float  # part of the stall spent in dcp.async_save (copying state to CPU); 0 if sync
    duration_s: float  # from the call to the commit marker
    bytes: int
    async_save: bool
    committed: bool = True


@dataclass(frozen=True)
class LoadedCheckpoint:
    step: int
    path: str
    trainspec_state: dict
    load_s: float
    fallbacks: list[str] = field(default_factory=list)


class Checkpointer:
    """Saves and loads checkpoints under `root`; create it on every rank, in the same order."""

    def __init__(
        self,
        root: str | Path,
        *,
        keep_last: int = 3,
        async_save: bool = True,
        timeout_s: float = 300.0,
        on_event: EventCallback | None = None,
    ) -> None:
        if keep_last < 1:
            raise ValueError(f"keep_last must be at least 1, got {keep_last}")
        if not dist.is_initialized():
            raise CheckpointError(
                "torch.distributed must be initialised before creating a Checkpointer"
            )
        self.root = Path(root)
        self.keep_last = keep_last
        self.async_save = async_save
        self.timeout_s = timeout_s
        self.on_event = on_event
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self._pg = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
        self.root.mkdir(parents=True, exist_ok=True)
        nonce = [secrets.token_hex(4) if self.rank == 0 else None]
        dist.broadcast_object_list(nonce, src=0, group=self._pg)
        self._nonce: str = nonce[0]  # type: ignore[assignment]
        self._pending: Future[SaveRecord | None] | None = None
        # One stager for the job: it keeps its CPU buffers between saves, halving the stall
        # (measured 8 -> 4 ms on the reference model). Safe because a save waits for the
        # previous one before staging into the same buffers.
        self._stager = DefaultStager(
            StagingOptions(
                use_pinned_memory=torch.cuda.is_available(),
                use_shared_memory=False,
                use_async_staging=False,
                use_non_blocking_copy=False,
            )
        )
        self.last_saved: SaveRecord | None = None

    # ---- saving -------------------------------------------------------------------------
    def save(
        self,
        step: int,
        *,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: Any | None = None,
        sampler: Any | None = None,
        trainspec_state: dict | None = None,
        reason: str = "periodic",
        block: bool = False,
    ) -> SaveRecord | None:
        """Start a checkpoint of `step` (all ranks call alike). Waits for the previous one first.

        Returns the record when the save completed within the call (sync, or `block=True`), None
        while an async save is in flight. A failed save is reported (reason "save_failed"),
        logged and leaves the previous committed checkpoint in place; it never raises here.
        """
        start = time.perf_counter()
        self.wait()
        waited = time.perf_counter() - start
        ckpt_dir = self.root / layout.dir_name(step, self._nonce)
        model_sd, optim_sd = get_state_dict(model, optimizer)
        extra = self._extra_state(scheduler, sampler, trainspec_state)  # RNG as of now
        state = {"model": model_sd, "optim": optim_sd}
        if self.async_save:
            staging = time.perf_counter()
            upload = dcp.async_save(
                state,
                checkpoint_id=str(ckpt_dir),
                process_group=self._pg,
                async_stager=self._stager,
            )
            stall = time.perf_counter() - start
            phases = {"wait_s": waited, "stage_s": stall - (staging - start)}
            self._pending = _in_daemon_thread(
                self._finish, step, reason, ckpt_dir, extra, upload, start, stall, phases
            )
            return self.wait() if block else None
        try:
            dcp.save(state, checkpoint_id=str(ckpt_dir), process_group=self._pg)
        except Exception as exc:  # reported and contained: the previous checkpoint still stands
            return self._failed(step, reason, ckpt_dir, exc)
        phases = {"wait_s": waited, "stage_s": 0.0}
        return self._finish(step, reason, ckpt_dir, extra, None, start, None, phases)

    def wait(self) -> SaveRecord | None:
        """Block until the in-flight save is committed (or failed); its record, or None."""
        pending, self._pending = self._pending, None
        return pending.result() if pending is not None else None

    def _finish(
        self,
        step: int,
        reason: str,
        ckpt_dir: Path,
        extra: bytes,
        upload: Future | None,
        start: float,
        stall: float | None,
        phases: dict[str, float],
    ) -> SaveRecord | None:
        try:
            (ckpt_dir / layout.EXTRA_DIR).mkdir(parents=True, exist_ok=True)
            layout.write_atomic(
                layout.extra_path(ckpt_dir, self.rank), extra
            )  # off the loop when async
            if upload is not None:
                upload.result(timeout=self.timeout_s)
            dist.barrier(group=self._pg)  # every rank's shard and extra state is on disk
            size = [0]
            if self.rank == 0:
                size[0] = layout.write_commit(
                    ckpt_dir, step=step, world_size=self.world_size, reason=reason
                )
                layout.apply_retention(self.root, self.keep_last)
            dist.broadcast_object_list(size, src=0, group=self._pg)  # all know it is committed
        except Exception as exc:
            return self._failed(step, reason, ckpt_dir, exc)
        duration = time.perf_counter() - start
        record = SaveRecord(
            step=step,
            reason=reason,
            path=str(ckpt_dir),
            stall_s=duration if stall is None else stall,
            wait_s=phases["wait_s"],
            stage_s=phases["stage_s"],
            duration_s=duration,
            bytes=int(size[0]),
            async_save=upload is not None,
        )
        self.last_saved = record
        self._emit(reason, {**asdict(record), "rank": self.rank})
        return record

    def _failed(self, step: int, reason: str, ckpt_dir: Path, exc: BaseException) -> None:
        log.warning("checkpoint of step %d failed (%s): %s", step, reason, exc)
        self._emit(
            "save_failed",
            {
                "step": step,
                "requested_reason": reason,
                "path": str(ckpt_dir),
                "error": str(exc),
                "rank": self.rank,
            },
        )
        return None

    # ---- loading ------------------------------------------------------------------------
    def load_latest(
        self,
        *,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: Any | None = None,
        sampler: Any | None = None,
    ) -> LoadedCheckpoint | None:
        """Restore the newest committed checkpoint that loads on every rank (all ranks call).

        Returns None when there is no committed checkpoint (a fresh start). Falls back past a
        corrupt one or one with a missing file, reporting each (reason "fallback"). Raises
        `WorldSizeMismatchError` for a checkpoint of another world size and `CheckpointError`
        when checkpoints exist but none loads; the model may then be partly overwritten.
        """
        self.wait()
        start = time.perf_counter()
        listing = [[str(c.path) for c in layout.committed_newest_first(self.root)]]
        dist.broadcast_object_list(listing, src=0, group=self._pg)  # one list for all ranks
        fallbacks: list[str] = []
        for path in listing[0]:
            c = _as_dir(Path(path))
            error = self._try_load(c, model, optimizer)
            if error is None:
                extra = json.loads(layout.extra_path(c.path, self.rank).read_text())
                _restore_extra(extra, scheduler, sampler)
                loaded = LoadedCheckpoint(
                    step=c.step,
                    path=str(c.path),
                    trainspec_state=extra.get("trainspec", {}),
                    load_s=time.perf_counter() - start,
                    fallbacks=fallbacks,
                )
                self._emit("loaded", {**asdict(loaded), "rank": self.rank})
                return loaded
            fallbacks.append(error)
            self._emit(
                "fallback", {"path": str(c.path), "step": c.step, "error": error, "rank": self.rank}
            )
        if fallbacks:
            raise CheckpointError(
                f"no committed checkpoint under {self.root} could be loaded: {'; '.join(fallbacks)}"
            )
        return None

    def _try_load(
        self, c: layout.CheckpointDir, model: torch.nn.Module, optimizer: torch.optim.Optimizer
    ) -> str | None:
        """None when `c` verified and loaded on every rank; otherwise why not."""
        error = ""
        try:
            layout.verify(c, world_size=self.world_size)
            json.loads(layout.extra_path(c.path, self.rank).read_text())
        except WorldSizeMismatchError:
            raise
        except (CorruptCheckpointError, OSError, ValueError) as exc:
            error = str(exc)
        if self._all_agree(not error):
            try:
                model_sd, optim_sd = get_state_dict(model, optimizer)
                state = {"model": model_sd, "optim": optim_sd}
                dcp.load(state, checkpoint_id=str(c.path), process_group=self._pg)
                set_state_dict(
                    model,
                    optimizer,
                    model_state_dict=state["model"],
                    optim_state_dict=state["optim"],
                )
            except Exception as exc:  # a failed read on any rank: fall back on all ranks alike
                error = f"checkpoint {c.path}: dcp load failed: {exc}"
            if self._all_agree(not error):
                return None
        return error or f"checkpoint {c.path}: another rank could not verify or load it"

    def _all_agree(self, ok: bool) -> bool:
        flag = torch.tensor([1 if ok else 0], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self._pg)
        return bool(flag.item())

    # ---- shared -------------------------------------------------------------------------
    def _extra_state(
        self, scheduler: Any | None, sampler: Any | None, trainspec_state: dict | None
    ) -> bytes:
        extra = {
            "rng": capture_rng(),
            "scheduler": scheduler.state_dict() if scheduler is not None else None,
            "sampler": sampler.state_dict() if sampler is not None else None,
            "trainspec": trainspec_state or {},
        }
        try:
            return json.dumps(extra).encode()
        except (TypeError, ValueError) as exc:
            raise CheckpointError(
                f"scheduler, sampler or trainspec state is not JSON-serialisable: {exc}"
            ) from exc

    def _emit(self, reason: str, evidence: dict) -> None:
        if self.on_event is None:
            return
        try:
            self.on_event(EVENT_KIND, reason, evidence)
        except Exception:  # a broken sink must not break checkpointing
            log.exception("checkpoint event callback failed")

    def close(self) -> SaveRecord | None:
        """Wait for the in-flight save, then release the worker thread and the side group."""
        record = self.wait()
        self._stager.close()
        dist.destroy_process_group(self._pg)
        return record


def _in_daemon_thread(fn: Callable[..., Any], *args: Any) -> Future:
    """Run `fn` on a daemon thread: unlike a ThreadPoolExecutor's worker, it never holds up
    interpreter exit when a peer died and the commit barrier is waiting out its timeout."""
    future: Future = Future()

    def run() -> None:
        try:
            future.set_result(fn(*args))
        except BaseException as exc:
            future.set_exception(exc)

    threading.Thread(target=run, name="trainspec-checkpoint-commit", daemon=True).start()
    return future


def _as_dir(path: Path) -> layout.CheckpointDir:
    step_text, nonce = path.name.removeprefix("step_").split("_", 1)
    return layout.CheckpointDir(path, int(step_text), nonce)


def _restore_extra(extra: dict, scheduler: Any | None, sampler: Any | None) -> None:
    restore_rng(extra["rng"])
    if scheduler is not None and extra.get("scheduler") is not None:
        scheduler.load_state_dict(extra["scheduler"])
    if sampler is not None and extra.get("sampler") is not None:
        sampler.load_state_dict(extra["sampler"])
