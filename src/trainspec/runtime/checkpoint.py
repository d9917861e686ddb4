"""Atomic, priced checkpoints of a training job, and resuming from the newest good one.

The Checkpointer saves model and optimizer through torch.distributed.checkpoint (dcp), and next
to them what dcp does not hold: LR scheduler, RNG states (torch, python, numpy), the batch
sampler's position, an opaque JSON dict of trainspec's own state, and tensors that only this
rank holds (`rank_tensors`: error feedback), each rank's in a file of its own. An async save
(the default) stalls the caller only while it snapshots the state into CPU buffers kept
between saves (`checkpoint_staging`); `dcp.save` of that snapshot, the commit and retention
then run on one long-lived daemon thread. That is what `dcp.async_save` does, minus the costs
it adds to the stall on every call: its deep-copying stager and a new upload thread per save.

Every collective runs on the Checkpointer's own gloo group with a timeout, never the default
group: dcp.async_save's background collectives on the default group once deadlocked against
DDP's next all-reduce. A checkpoint counts only once rank 0 has written its COMMIT marker
after a barrier that every rank reaches when its data is on disk (see `checkpoint_layout`).
Loading takes the newest committed checkpoint that verifies on every rank, falling back to
the previous one (reported) for a corrupt or missing file, and raises a `CheckpointError`
rather than resume wrongly (another world size; a sampler saved with another dataset, global
batch or seed, refused before anything is loaded; nothing loadable), in one line
(`checkpoint_errors`). Each save's cost (stall,
duration, bytes) and each fallback are reported through `on_event(kind, reason, evidence)`,
with kind "checkpoint"; a callback that raises is logged and ignored.

One save per step: a step this Checkpointer has committed since its last load, or is still
saving, is not saved again (`save` waits for the in-flight one and returns the committed
record), and no save writes into a directory that already has a COMMIT marker (it fails on
every rank alike, reported as "save_failed"): rewriting a committed checkpoint in place left
nothing loadable when the process died part-way through (a preemption save of the step just
saved). A load starts a new directory nonce: after a rollback (a load of an older checkpoint
than this job's newest) the steps the job retraces are saved into new directories beside
those of the abandoned trajectory, where they had been refused as already committed, and
the newest save of a step is the one loaded first (`checkpoint_layout.list_checkpoints`).

Each save measures whether the state it holds is finite (off the training thread when async)
and records it, with the anomaly in progress it is told of, in the manifest: a checkpoint of a
diverged state never counts toward `keep_last` and is loaded only when no finite one loads
(`checkpoint_layout`). Every floating tensor is read for NaN, buffers and frozen parameters
too (a NaN running mean is as diverged as a NaN weight); an infinity counts only in a trained
parameter or optimizer state, since a buffer such as a causal mask holds -inf by design.
`optimizer` may be one optimizer or a list or tuple of them (disjoint parameters): their
states are saved together, by parameter name, and each gets its own back on load.
"""

from __future__ import annotations

import json
import logging
import secrets
import time
import warnings
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.tensor import DTensor

from trainspec.runtime import arguments
from trainspec.runtime import checkpoint_layout as layout
from trainspec.runtime.checkpoint_errors import failure_cause, sampler_misfit, summarise_fallbacks
from trainspec.runtime.checkpoint_layout import (
    CheckpointError,
    CorruptCheckpointError,
    SamplerMismatchError,
    WorldSizeMismatchError,
)
from trainspec.runtime.checkpoint_staging import StateStager
from trainspec.runtime.identity import launched_world_size
from trainspec.runtime.rank_tensors import snapshot as snapshot_tensors
from trainspec.runtime.rank_tensors import write as write_tensors
from trainspec.runtime.rng_state import encode_rng, restore_rng, snapshot_rng
from trainspec.runtime.save_worker import SaveWorker

__all__ = [
    "CheckpointError",
    "Checkpointer",
    "CorruptCheckpointError",
    "LoadedCheckpoint",
    "SamplerMismatchError",
    "SaveRecord",
    "WorldSizeMismatchError",
]

log = logging.getLogger(__name__)
_DCP_SOLO_WARNING = "torch.distributed is disabled, unavailable or uninitialized"
EventCallback = Callable[[str, str, dict], None]
EVENT_KIND = "checkpoint"
_PEER_FAILED = "another rank could not prepare its part of this checkpoint"
# Why a newer checkpoint was passed over at load (after "checkpoint <path>: ")
DIVERGED_NOTE = (
    "non-finite state saved (a NaN, or an infinite weight or optimizer state: a diverged "
    "state); tried after the finite ones"
)
# dcp reports a failed write or read as a CheckpointException, which is a BaseException: an
# `except Exception` lets it through, and it ended training on every rank.
_FAILURES = (Exception, CheckpointException)
# One optimizer, or several over disjoint parameters (torch's get_state_dict takes either)
Optimizers = torch.optim.Optimizer | Sequence[torch.optim.Optimizer]


def _whole_number(name: str, value: Any, minimum: int) -> int:
    number = arguments.whole_number(name, value)
    if number < minimum:
        raise ValueError(f"{name} must be at least {minimum}, got {number}")
    return number


@dataclass(frozen=True)
class SaveRecord:
    step: int
    reason: str
    path: str
    stall_s: float  # time the training loop was blocked by this save
    wait_s: float  # part of the stall spent waiting for the previous save to commit
    stage_s: float  # part of the stall spent snapshotting state (RNG, state to CPU); 0 if sync
    duration_s: float  # from the call to the commit marker
    bytes: int
    async_save: bool
    committed: bool = True
    finite: bool = True  # no NaN saved, no infinity in a trained weight or optimizer state
    anomaly: str | None = None  # the trouble in progress when it was taken, as told


@dataclass(frozen=True)
class LoadedCheckpoint:
    step: int
    path: str
    trainspec_state: dict
    load_s: float
    fallbacks: list[str] = field(default_factory=list)


class Checkpointer:
    """Saves and loads checkpoints under `root`; create it on every rank, in the same order
    (in one process with no process group it works alone)."""

    def __init__(
        self,
        root: str | Path,
        *,
        keep_last: int = 3,
        async_save: bool = True,
        timeout_s: float = 300.0,
        on_event: EventCallback | None = None,
    ) -> None:
        keep_last = _whole_number("keep_last", keep_last, 1)
        if Path(root).exists() and not Path(root).is_dir():  # mkdir's FileExistsError killed
            raise ValueError(f"checkpoint directory {root} is not a directory")  # the job
        if not (isinstance(timeout_s, (int, float)) and timeout_s > 0):
            raise ValueError(f"timeout_s must be a positive number of seconds, got {timeout_s!r}")
        self.root = Path(root)
        self.keep_last = keep_last
        self.async_save = async_save
        self.timeout_s = timeout_s
        self.on_event = on_event
        # One process with no process group (a single-GPU job) saves and loads alone:
        # dcp's `no_dist`, and no collective of ours.
        self._solo = not (dist.is_available() and dist.is_initialized())
        if self._solo and launched_world_size() > 1:  # each would save as rank 0 of 1
            raise CheckpointError(
                "torch.distributed must be initialised before creating a Checkpointer in a "
                "job of several ranks"
            )
        self.rank = 0 if self._solo else dist.get_rank()
        self.world_size = 1 if self._solo else dist.get_world_size()
        self._pg = None
        if self._solo:  # dcp says so on every save and load: it is the intent here
            warnings.filterwarnings("ignore", message=_DCP_SOLO_WARNING, category=UserWarning)
        else:
            self._pg = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
        self.root.mkdir(parents=True, exist_ok=True)
        nonce = [_new_nonce() if self.rank == 0 else None]
        self._broadcast(nonce)
        self._nonce: str = nonce[0]  # type: ignore[assignment]
        self._pending: Future[SaveRecord | None] | None = None
        self._pending_dir: Path | None = None  # the directory the in-flight save writes
        self._damaged: set[Path] = set()  # checkpoints this rank found unlike their manifest
        # One stager for the job: it keeps its CPU buffers between saves. Safe because a save
        # waits for the previous one before staging into the same buffers.
        self._stager = StateStager(pin_memory=torch.cuda.is_available())
        self._worker = SaveWorker()
        self.last_saved: SaveRecord | None = None
        self.saves_started = 0  # saves begun (a step already committed is not begun again)
        self._closed = False

    def _check_open(self, what: str) -> None:
        if self._closed:
            raise CheckpointError(f"{what} after close(): this Checkpointer is closed")

    # ---- saving -------------------------------------------------------------------------
    def save(
        self,
        step: int,
        *,
        model: torch.nn.Module,
        optimizer: Optimizers,
        scheduler: Any | None = None,
        sampler: Any | None = None,
        trainspec_state: dict | None = None,
        rank_tensors: dict[str, torch.Tensor] | None = None,
        reason: str = "periodic",
        block: bool = False,
        anomaly: str | None = None,
    ) -> SaveRecord | None:
        """Start a checkpoint of `step` (all ranks call alike). Waits for the previous one first.

        `trainspec_state` (JSON) and `rank_tensors` (copied to the CPU within the call) are
        this rank's own: each rank's are saved apart, and loaded back by that rank alone.
        `anomaly` (the trouble in progress, e.g. "loss spike since step 16") goes into the
        manifest: retention keeps the newest checkpoint taken with none beside these.

        Returns the record when the save completed within the call (sync, or `block=True`), None
        while an async save is in flight. A step this Checkpointer has committed since its last
        load is not saved again: its record is returned (one still in flight is waited for first, and saved
        again only if it failed). A failed save is reported (reason "save_failed"), logged and
        leaves the previous committed checkpoint in place; it never raises here.
        """
        self._check_open("save")
        step = _whole_number("step", step, 0)
        ckpt_dir = self.root / layout.dir_name(step, self._nonce)
        if self._pending is not None and self._pending_dir == ckpt_dir:  # the same, in flight
            self.wait()  # as any save waits for the one before it; saved again if it failed
        last = self.last_saved
        if last is not None and last.path == str(ckpt_dir):  # every rank saw it commit
            log.info("checkpoint of step %d (%s): already committed", step, reason)
            return last
        self.saves_started += 1
        start = time.perf_counter()
        self.wait()  # also what makes reusing the staging buffers safe
        waited = time.perf_counter() - start
        rng = snapshot_rng()  # as of now: encoded to JSON off the loop when async
        problem: Exception | None = None  # a failure on this rank, agreed on before dcp.save
        if (ckpt_dir / layout.COMMIT_NAME).is_file():  # never write into a committed checkpoint
            problem = CheckpointError(f"{ckpt_dir} is already committed: not written again")
        mine: dict[str, torch.Tensor] = {}
        others = ""
        try:
            if problem is None:
                others = _other_state(scheduler, sampler, trainspec_state)
                mine = snapshot_tensors(rank_tensors or {})
        except Exception as exc:  # not JSON, or no memory for the copies: reported, not raised
            problem, others = exc, ""
        if self.async_save:
            staging = time.perf_counter()
            staged: dict | None = None
            if problem is None:
                try:
                    staged = self._stager.stage(model, optimizer)
                except Exception as exc:  # e.g. no memory for the buffers: reported, not raised
                    problem = exc
            stall = time.perf_counter() - start
            phases = {"wait_s": waited, "stage_s": stall - (staging - start)}
            # Submitted even after a failure here: the job's vote is how the other ranks,
            # already on their way into dcp.save's collectives, learn to skip this save.
            self._pending_dir = ckpt_dir
            self._pending = self._worker.submit(
                self._finish, step, reason, ckpt_dir, (rng, others, mine), staged, start, stall,
                phases, problem, anomaly,
            )  # fmt: skip
            return self.wait() if block else None
        try:
            if not self._all_agree(problem is None):
                raise problem or CheckpointError(_PEER_FAILED)
            model_sd, optim_sd = get_state_dict(model, _optimizers(optimizer))
            state = {"model": model_sd, "optim": optim_sd}
            finite = _finite_state(state)
            dcp.save(state, checkpoint_id=str(ckpt_dir), process_group=self._pg, no_dist=self._solo)
        except _FAILURES as exc:  # reported and contained: the previous checkpoint still stands
            self._failed(step, reason, ckpt_dir, exc)
            return None
        phases = {"wait_s": waited, "stage_s": 0.0}
        return self._finish(
            step, reason, ckpt_dir, (rng, others, mine), None, start, None, phases, None,
            anomaly, finite,
        )  # fmt: skip

    def covers(self, step: int) -> bool:
        """True when this Checkpointer's latest save, committed or still in flight, is of
        `step`: `save(step)` makes no new one (unless the one in flight fails)."""
        ckpt_dir = self.root / layout.dir_name(step, self._nonce)
        if self._pending is not None and self._pending_dir == ckpt_dir:
            return True
        return self.last_saved is not None and self.last_saved.path == str(ckpt_dir)

    @property
    def in_flight(self) -> bool:
        """True while an async save started here has neither committed nor failed."""
        pending = self._pending
        return pending is not None and not pending.done()

    def wait(self) -> SaveRecord | None:
        """Block until the in-flight save is committed (or failed); its record, or None."""
        pending, self._pending = self._pending, None
        return pending.result() if pending is not None else None

    def _finish(
        self,
        step: int,
        reason: str,
        ckpt_dir: Path,
        extra: tuple[dict, str, dict[str, torch.Tensor]],
        staged: dict | None,
        start: float,
        stall: float | None,
        phases: dict[str, float],
        problem: Exception | None = None,
        anomaly: str | None = None,
        finite: bool | None = None,
    ) -> SaveRecord | None:
        """Write what is not on disk yet and commit; on the worker thread when async. Every
        rank votes first, so a failure on one rank fails the save on all, none waiting out a
        collective timeout and none committing a directory that lacks a rank's part; the
        same vote tells every rank whether every rank's state was finite (`finite`, measured
        here on the snapshot when None)."""
        try:
            if finite is None:
                finite = _finite_state(staged) if staged is not None else True
            if problem is None:
                try:
                    (ckpt_dir / layout.EXTRA_DIR).mkdir(parents=True, exist_ok=True)
                    rng, others, mine = extra
                    layout.write_atomic(
                        layout.extra_path(ckpt_dir, self.rank), _encode_extra(rng, others)
                    )
                    if mine:
                        write_tensors(ckpt_dir, self.rank, mine)
                except (OSError, TypeError, ValueError, RuntimeError) as exc:
                    problem = exc
            ok, finite = self._agree_each([problem is None, finite])
            if not ok:
                raise problem or CheckpointError(_PEER_FAILED)
            if staged is not None:  # the snapshot: the loop may already be changing the model
                dcp.save(
                    staged, checkpoint_id=str(ckpt_dir), process_group=self._pg,
                    no_dist=self._solo,
                )  # fmt: skip
            if self._pg is not None:
                dist.barrier(group=self._pg)  # every rank's shard and extra state is on disk
            outcome: list[int | str] = [0]
            if self.rank == 0:
                outcome[0] = self._commit(ckpt_dir, step, reason, finite, anomaly)
            # Always reached by rank 0, failed commit or not: the others wait here for it.
            self._broadcast(outcome)  # all know the outcome
            if isinstance(outcome[0], str):
                raise CheckpointError(outcome[0])
            size = [outcome[0]]
        except _FAILURES as exc:
            self._failed(step, reason, ckpt_dir, exc)
            return None
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
            async_save=staged is not None,
            finite=finite,
            anomaly=anomaly,
        )
        self.last_saved = record
        self._emit(reason, {**asdict(record), "rank": self.rank})
        return record

    def _commit(
        self, ckpt_dir: Path, step: int, reason: str, finite: bool, anomaly: str | None
    ) -> int | str:
        """Rank 0: write the commit marker, then apply retention. The checkpoint's size, or
        why it was not committed (a retention failure leaves it committed, and is logged)."""
        if not finite:
            log.warning("trainspec: the checkpoint of step %d holds a NaN, or an infinite "
                        "weight or optimizer state: kept aside from keep_last, loaded only "
                        "when no finite checkpoint loads", step)  # fmt: skip
        try:
            size = layout.write_commit(
                ckpt_dir, step=step, world_size=self.world_size, reason=reason, finite=finite,
                anomaly=anomaly,
            )  # fmt: skip
        except Exception as exc:
            return f"commit marker not written: {type(exc).__name__}: {exc}"
        try:
            layout.apply_retention(self.root, self.keep_last)
        except Exception as exc:
            log.warning("checkpoint retention under %s failed: %s", self.root, exc)
        return size

    def _failed(self, step: int, reason: str, ckpt_dir: Path, exc: BaseException) -> None:
        try:
            error = str(exc)
        except Exception:  # an exception whose text cannot be made: its type says enough
            error = type(exc).__name__
        log.warning("checkpoint of step %d failed (%s): %s", step, reason, error)
        self._emit(
            "save_failed",
            {
                "step": step,
                "requested_reason": reason,
                "path": str(ckpt_dir),
                "error": error,
                "rank": self.rank,
            },
        )
        return None

    # ---- loading ------------------------------------------------------------------------
    def load_latest(
        self,
        *,
        model: torch.nn.Module,
        optimizer: Optimizers,
        scheduler: Any | None = None,
        sampler: Any | None = None,
    ) -> LoadedCheckpoint | None:
        """Restore the newest committed checkpoint that loads on every rank (all ranks call).

        Returns None when there is no committed checkpoint (a fresh start). A checkpoint whose
        state is not finite is tried only after every finite one (a warning names it). Saves
        made after the call go into new directories (a new nonce), so a step retraced after a
        rollback is saved again, not refused as committed.
        Falls back past a corrupt one or one with a missing file, reporting each (reason
        "fallback"). Raises
        `WorldSizeMismatchError` for a checkpoint of another world size,
        `SamplerMismatchError` for one whose sampler state `sampler` cannot take (another
        dataset, global batch or seed; before anything is loaded), and `CheckpointError`
        when checkpoints exist but none loads; the model may then be partly overwritten.
        Each error is one line.
        """
        self._check_open("load_latest")
        self.wait()
        self._stager.forget()  # loading gives the optimizer new state tensors
        start = time.perf_counter()
        # One list for all ranks, and a new nonce: after a rollback the steps the job retraces
        # were saved once already, in this nonce's directories, which are committed.
        listing = [([str(c.path) for c in layout.load_order(self.root)], _new_nonce())]
        self._broadcast(listing)
        order, self._nonce = listing[0]
        passed = self._diverged_passed(order)
        fallbacks: list[str] = []
        passed_over: list[layout.CheckpointDir] = []
        for path in order:
            c = _as_dir(Path(path))
            error = self._try_load(c, model, optimizer, sampler)
            if error is None:
                extra = json.loads(layout.extra_path(c.path, self.rank).read_text())
                _restore_extra(extra, scheduler, sampler)
                self._set_aside(passed_over)
                loaded = LoadedCheckpoint(
                    step=c.step,
                    path=str(c.path),
                    trainspec_state=extra.get("trainspec", {}),
                    load_s=time.perf_counter() - start,
                    # (a non-finite one that loads is not one passed over)
                    fallbacks=[
                        *(n for n in passed if not n.startswith(f"checkpoint {c.path}:")),
                        *fallbacks,
                    ],  # fmt: skip
                )
                self._emit("loaded", {**asdict(loaded), "rank": self.rank})
                return loaded
            fallbacks.append(error)
            passed_over.append(c)
            if self.rank == 0:
                then = _next_tried(order, len(fallbacks), c.step)
                log.warning("trainspec: %s; %s", error, then)
            self._emit(
                "fallback", {"path": str(c.path), "step": c.step, "error": error, "rank": self.rank}
            )
        if fallbacks:
            failed = [(c.path, error) for c, error in zip(passed_over, fallbacks, strict=True)]
            raise CheckpointError(summarise_fallbacks(self.root, failed))
        return None

    def _diverged_passed(self, order: list[str]) -> list[str]:
        """Why each checkpoint newer than the first in `order` comes later: its saved state
        is not finite (`layout.load_order`). Warned about by rank 0."""
        if not order:
            return []
        first = _as_dir(Path(order[0]))
        notes = []
        for path in order[1:]:
            c = _as_dir(Path(path))
            if c.step > first.step:
                notes.append(f"checkpoint {c.path}: {DIVERGED_NOTE}")
        if notes and self.rank == 0:
            log.warning("trainspec: %s", "; ".join(notes))
        return notes

    def _set_aside(self, passed_over: list[layout.CheckpointDir]) -> None:
        """Rename the damaged checkpoints an older one was loaded past (rank 0, once every
        rank has loaded): counted as committed, they were kept by retention as the newest while the
        good ones the resumed job wrote were deleted, until none that loads was left. Kept
        under another name, not deleted (the evidence of what went wrong). Where nothing
        loads, nothing is set aside: the error stands and a restart finds the same."""
        if self.rank != 0:
            return
        # Only what this rank found damaged (every rank checks every file against the
        # manifest): a read that failed for a reason of the moment (an I/O error, no memory
        # for dcp's load) leaves a checkpoint that may load next time where it was.
        for c in (c for c in passed_over if c.path in self._damaged):
            try:
                aside = layout.set_aside(c)
            except OSError as exc:
                log.warning("trainspec: could not set aside %s: %s", c.path, exc)
                continue
            log.warning("trainspec: %s set aside as %s (it did not load)", c.path.name, aside.name)

    def _try_load(
        self,
        c: layout.CheckpointDir,
        model: torch.nn.Module,
        optimizer: Optimizers,
        sampler: Any | None = None,
    ) -> str | None:
        """None when `c` verified and loaded on every rank; otherwise why not, in one line.
        Raises SamplerMismatchError on every rank, before loading, where `sampler` cannot
        take any rank's sampler state of `c`."""
        error = misfit = ""
        try:
            layout.verify(c, world_size=self.world_size)
            extra = json.loads(layout.extra_path(c.path, self.rank).read_text())
            misfit = sampler_misfit(c.path, sampler, extra)
        except WorldSizeMismatchError:
            raise
        except CorruptCheckpointError as exc:  # its files do not match its manifest
            error = str(exc)
            self._damaged.add(c.path)
        except (OSError, ValueError) as exc:
            error = str(exc)
        if not self._all_agree(not misfit):  # every rank alike: none goes on into dcp.load
            raise SamplerMismatchError(
                misfit or f"checkpoint {c.path}: another rank's sampler cannot continue from it"
            )
        if self._all_agree(not error):
            try:
                optimizers = _optimizers(optimizer)
                model_sd, optim_sd = get_state_dict(model, optimizers)
                state: dict[str, Any] = {"model": model_sd, "optim": optim_sd}
                dcp.load(
                    state, checkpoint_id=str(c.path), process_group=self._pg,
                    no_dist=self._solo,
                )  # fmt: skip
                set_state_dict(
                    model,
                    optimizers,
                    model_state_dict=state["model"],
                    optim_state_dict=state["optim"],
                )
            except _FAILURES as exc:  # a failed read on any rank: fall back on all ranks alike
                error = f"checkpoint {c.path}: dcp load failed: {failure_cause(exc)}"
            if self._all_agree(not error):
                return None
        return error or f"checkpoint {c.path}: another rank could not verify or load it"

    def _broadcast(self, box: list[Any]) -> None:
        """Rank 0's `box[0]` on every rank (nothing to do alone)."""
        if self._pg is not None:
            dist.broadcast_object_list(box, src=0, group=self._pg)

    def _all_agree(self, ok: bool) -> bool:
        return self._agree_each([ok])[0]

    def _agree_each(self, flags: list[bool]) -> list[bool]:
        """Each flag true on every rank (one collective for them all)."""
        if self._pg is None:
            return list(flags)
        votes = torch.tensor([1 if ok else 0 for ok in flags], dtype=torch.int32)
        dist.all_reduce(votes, op=dist.ReduceOp.MIN, group=self._pg)
        return [bool(v) for v in votes.tolist()]

    # ---- shared -------------------------------------------------------------------------
    def _emit(self, reason: str, evidence: dict) -> None:
        if self.on_event is None:
            return
        try:
            self.on_event(EVENT_KIND, reason, evidence)
        except Exception:  # a broken sink must not break checkpointing
            log.exception("checkpoint event callback failed")

    def close(self) -> SaveRecord | None:
        """Wait for the in-flight save, then release the worker thread and the side group.
        A second call does nothing; saving or loading afterwards raises CheckpointError."""
        if self._closed:
            return None
        self._closed = True
        record = self.wait()
        self._worker.close()
        self._stager.close()
        if self._pg is not None:
            dist.destroy_process_group(self._pg)
        return record


def _optimizers(optimizer: Optimizers) -> Any:
    """What torch's get_state_dict / set_state_dict take: one optimizer, or a tuple of them."""
    return tuple(optimizer) if isinstance(optimizer, (list, tuple)) else optimizer


def _finite_state(state: dict) -> bool:
    """False when any floating tensor in `state` (get_state_dict's layout: {"model": {fqn:
    tensor}, "optim": {"state": {fqn: {...}}, "param_groups": [{"params": [fqn, ...]}]}})
    holds a NaN, or a parameter an optimizer updates or an optimizer state tensor holds an
    infinity. Buffers and frozen parameters are read for NaN only: a causal mask of -inf is
    no divergence, a NaN running mean or frozen embedding is."""
    try:  # never raises: the other ranks are on their way into the save's vote
        model, optim = state.get("model") or {}, state.get("optim") or {}
        trained = {fqn for g in optim.get("param_groups", []) for fqn in g["params"]}
        finite = [t for fqn, t in model.items() if fqn in trained]
        for entry in (optim.get("state") or {}).values():
            finite += list(entry.values()) if isinstance(entry, dict) else []
        no_nan = [t for fqn, t in model.items() if fqn not in trained]
        checks: dict[torch.device, list[torch.Tensor]] = {}
        for tensors, holds in ((finite, torch.isfinite), (no_nan, _not_nan)):
            for t in tensors:
                if not isinstance(t, torch.Tensor):
                    continue
                local = t.to_local() if isinstance(t, DTensor) else t
                if local.numel() and (local.is_floating_point() or local.is_complex()):
                    checks.setdefault(local.device, []).append(holds(local).all())
        return all(bool(torch.stack(flags).all()) for flags in checks.values())  # a sync each
    except Exception as exc:  # an unforeseen layout: unmeasured, taken as finite
        log.warning("trainspec: could not check the checkpoint's state for non-finite values: "
                    "%s", exc)  # fmt: skip
        return True


def _not_nan(t: torch.Tensor) -> torch.Tensor:
    return ~torch.isnan(t)


def _new_nonce() -> str:
    """The part of a directory name that tells one job launch's, or one load's, saves of a
    step from another's (`checkpoint_layout.dir_name`)."""
    return secrets.token_hex(4)


def _other_state(scheduler: Any | None, sampler: Any | None, trainspec_state: dict | None) -> str:
    """Scheduler, sampler and trainspec state as JSON now: the text is the snapshot."""
    try:
        return json.dumps(
            {
                "scheduler": scheduler.state_dict() if scheduler is not None else None,
                "sampler": sampler.state_dict() if sampler is not None else None,
                "trainspec": trainspec_state or {},
            }
        )
    except (TypeError, ValueError) as exc:
        raise CheckpointError(
            f"scheduler, sampler or trainspec state is not JSON-serialisable: {exc}"
        ) from exc


def _encode_extra(rng: dict, others: str) -> bytes:
    return json.dumps({"rng": encode_rng(rng), **json.loads(others)}).encode()


def _as_dir(path: Path) -> layout.CheckpointDir:
    step_text, nonce = path.name.removeprefix("step_").split("_", 1)
    return layout.CheckpointDir(path, int(step_text), nonce)


def _restore_extra(extra: dict, scheduler: Any | None, sampler: Any | None) -> None:
    restore_rng(extra["rng"])
    if scheduler is not None and extra.get("scheduler") is not None:
        scheduler.load_state_dict(extra["scheduler"])
    if sampler is not None and extra.get("sampler") is not None:
        sampler.load_state_dict(extra["sampler"])


def _next_tried(order: list[str], failed: int, step: int) -> str:
    """What loading does after the `failed`-th checkpoint of `order`, of `step`, failed: an
    older one is tried, or (non-finite ones come after every finite one) a newer one; "no
    older checkpoint left" after the last."""
    if failed >= len(order):
        return "no older checkpoint left"
    following = _as_dir(Path(order[failed])).step
    return "trying an older checkpoint" if following < step else "trying a newer checkpoint"
