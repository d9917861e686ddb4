"""The actuator's own state in a checkpoint, so a resumed job goes on with the plan it had.

`ActuatorState.snapshot` runs at every checkpoint of `actuate()`'s Checkpointer and `restore`
in `Actuation.resume()`. Each rank saves its own, under "actuator" in the checkpoint's JSON
trainspec state (`extra/rank<r>.json`):

- "compression": the level the next step runs at (a switch decided at the checkpoint's own
  boundary included) and the configured level (`kernels.compression`) the job started from;
- "micro_batch": this rank's limit, the smallest micro-batch that ran out of memory on it,
  and the configured size (`micro_batch=` or `actuator.micro_batch`);
- "controller": the detectors' and policies' hysteresis (`actuator/control_state.py`);
- "episode": the loss-spike reference and the loss anomaly in progress
  (`runtime/checkpoint_episode.py`), so a job restarted in the middle of one goes on with it;
- "error_feedback": how many parameters' residuals this rank saved. The residuals themselves,
  one flat piece per parameter name, are this rank's tensor file (`rank_tensors.py`): they
  differ on every rank, so they cannot be one replicated key of dcp's state dict. Version 2
  saves each piece in the parameter's logical order; version 1 (before 2026-11-27) saved a
  non-contiguous parameter's (`channels_last`, a transposed matrix) in the bucket's memory
  order, and is read so (`kernels/residual_layout.py`).

Restoring is collective (every rank calls it at the same point). Each rank checks its own
state, then one all_gather on the control group shows every rank every rank's verdict: a
malformed state anywhere is a CheckpointError on every rank, never one rank resuming alone.
The level, the controller's state and the episode are shared decisions, so every rank applies
rank 0's; the level from the hook's next step, the same step on every rank. The micro-batch
limit and the error feedback are each rank's own (an OOM retry shrinks one rank's limit; the
next window reconciles). A checkpoint without this state (an older trainspec) changes
nothing, and a missing key keeps its default. A configuration changed since the save wins: the level comes
back only while `kernels.compression` is what it was then, the limit only while the
configured micro-batch is and the limit is allowed (not below `actuator.min_micro_batch`).

With the actuator switched off (`TRAINSPEC_ACTUATOR=off`, `actuator.enabled = false`) the
checkpoint's plan is not restored: the job runs as a fresh one with the actuator off would,
at the configured level and micro-batch and on equal shares (nothing could move a restored
plan back), with one warning. The sampler's epoch and position are still the checkpoint's
(only its shares go back to equal: the same samples, split evenly), and so is the error
feedback (gradient still owed, added at the next exchange whatever the level).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from trainspec.actuator import Controller
from trainspec.actuator.control_state import (
    check_controller_state,
    controller_state,
    load_controller_state,
)
from trainspec.actuator.micro_batch import WHOLE_SHARE, MicroBatchPlan
from trainspec.actuator.state_fields import StateError
from trainspec.config import kill_switch_on
from trainspec.kernels.codecs import LevelError, parse_level
from trainspec.kernels.hook import configured_level
from trainspec.kernels.residual_layout import layout_of, logical_piece
from trainspec.runtime import rank_tensors
from trainspec.runtime.checkpoint_episode import (
    EPISODE_KEY,
    check_episode_state,
    episode_state,
    load_episode_state,
)
from trainspec.runtime.checkpoint_layout import CheckpointError
from trainspec.runtime.hook_wiring import hook_of, is_hooked

log = logging.getLogger("trainspec.actuator")
STATE_KEY = "actuator"  # in the checkpoint's trainspec state
VERSION = 2  # 2: error-feedback pieces in logical order (1: in the bucket's memory order)


@dataclass(frozen=True)
class SavedState:
    """One rank's saved actuator state, checked; None where the checkpoint did not say."""

    level: str | None = None
    configured_level: str | None = None
    limit: int | None = None
    oom_at: int = 0
    configured_micro_batch: int | None = None
    controller: dict[str, Any] | None = None
    episode: dict[str, Any] | None = None  # the loss-spike episode (checkpoint_episode.py)
    error_feedback: int = 0  # parameters whose residuals are in the rank's tensor file
    version: int = VERSION

    def shared(self) -> dict[str, Any]:
        """What every rank takes from rank 0: the same on every rank when saved."""
        return {
            "level": self.level,
            "configured_level": self.configured_level,
            "controller": self.controller,
            "episode": self.episode,
        }


def parse(trainspec_state: Any) -> SavedState | None:
    """The "actuator" entry of a checkpoint's trainspec state; None when there is none.
    Raises CheckpointError naming the key of a malformed value."""
    if not isinstance(trainspec_state, dict):
        raise CheckpointError(f"trainspec state must be an object, got {trainspec_state!r:.80}")
    raw = trainspec_state.get(STATE_KEY)
    if raw is None:
        return None
    raw = _object(raw, STATE_KEY)
    version = _count(raw, "version", VERSION, STATE_KEY)
    if not 1 <= version <= VERSION:
        raise CheckpointError(
            f"{STATE_KEY}.version {version}: this trainspec reads versions 1 to {VERSION}"
        )
    comp = _object(raw.get("compression", {}), f"{STATE_KEY}.compression")
    micro = _object(raw.get("micro_batch", {}), f"{STATE_KEY}.micro_batch")
    feedback = _object(raw.get("error_feedback", {}), f"{STATE_KEY}.error_feedback")
    controller = raw.get("controller")
    if controller is not None:
        controller = _object(controller, f"{STATE_KEY}.controller")
    episode = raw.get(EPISODE_KEY)
    if episode is not None:
        episode = _object(episode, f"{STATE_KEY}.{EPISODE_KEY}")
    return SavedState(
        level=_level(comp, "level", f"{STATE_KEY}.compression"),
        configured_level=_level(comp, "configured", f"{STATE_KEY}.compression"),
        limit=_count(micro, "limit", None, f"{STATE_KEY}.micro_batch"),
        oom_at=_count(micro, "oom_at", 0, f"{STATE_KEY}.micro_batch") or 0,
        configured_micro_batch=_count(micro, "configured", None, f"{STATE_KEY}.micro_batch"),
        controller=controller,
        episode=episode,
        error_feedback=_count(feedback, "parameters", 0, f"{STATE_KEY}.error_feedback") or 0,
        version=version,
    )


def _object(value: Any, where: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise CheckpointError(f"{where} must be an object, got {value!r:.80}")
    return value


def _count(state: dict[str, Any], key: str, default: int | None, where: str) -> Any:
    value = state.get(key, default)
    if value is None and default is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise CheckpointError(f"{where}.{key} must be a whole number >= 0, got {value!r:.80}")
    return value


def _level(state: dict[str, Any], key: str, where: str) -> str | None:
    value = state.get(key)
    if value is None:
        return None
    if not isinstance(value, str):
        raise CheckpointError(f"{where}.{key} must be a compression level, got {value!r:.80}")
    try:
        return str(parse_level(value))
    except LevelError as exc:
        raise CheckpointError(f"{where}.{key}: {exc}") from None


def _limit_kept_because(saved: SavedState, plan: MicroBatchPlan) -> str | None:
    """Why the saved micro-batch limit is not restored; None when it is."""
    limit = saved.limit
    if limit is None:
        return "not saved"
    if saved.configured_micro_batch not in (None, plan.configured):
        return (f"the configured micro-batch is {plan.configured}, was "
                f"{saved.configured_micro_batch} at the save: the configuration wins")  # fmt: skip
    if limit == WHOLE_SHARE:
        return None
    if limit < plan.minimum:
        return f"limit {limit} is below actuator.min_micro_batch {plan.minimum}"
    if plan.configured != WHOLE_SHARE and limit > plan.configured:
        return f"limit {limit} is above the configured micro-batch {plan.configured}"
    return None


class ActuatorState:
    """Snapshot and restore of one rank's actuator state (see the module docstring).

    `controller` is set once the controller exists (it is built after the checkpoint
    callback that snapshots through this)."""

    def __init__(
        self,
        *,
        hook: Any,
        plan: MicroBatchPlan,
        model: Any,
        configured_level: str | None,
        rank: int,
        group: Any,
        switched_off: bool = False,
        sampler: Any = None,
    ) -> None:
        """`switched_off`: the actuator's kill switch or `actuator.enabled = false` (not a
        job without a controller for another reason: one process still shrinks its limit
        after an OOM); `sampler`: the ShareBatchSampler whose shares go back to equal then."""
        self.hook = hook  # kernels.hook.CompressionHook, or None (collector off, sparse model)
        # The error feedback a checkpoint holds is that of the model it saves: with several
        # models (a HookSet), that model's own hook.
        self.feedback = hook_of(model) if is_hooked(model) else hook
        self.plan = plan
        self.model = model
        self.configured_level = configured_level
        self.rank = rank
        self.group = group  # the control group: None in one process
        self.controller: Controller | None = None
        self.switched_off = switched_off
        self.sampler = sampler  # its shares go back to equal with the actuator off

    @classmethod
    def for_session(
        cls, session: Any, plan: MicroBatchPlan, model: Any, sampler: Any = None
    ) -> ActuatorState:
        """The state of `session`'s actuator: its hook, its configured level, its control
        group, whether it is switched off (as `actuate()` settles it), and its sampler."""
        try:
            level: str | None = str(configured_level(session.config.kernels))
        except LevelError:  # checked when the config loaded; the hook would not exist either
            level = None
        groups = session.groups
        return cls(
            hook=session.hook, plan=plan, model=model, configured_level=level,
            rank=session.identity.rank, group=groups.control if groups is not None else None,
            switched_off=kill_switch_on() or not session.config.actuator.enabled, sampler=sampler,
        )  # fmt: skip

    # ---- saving -------------------------------------------------------------------------
    def snapshot(self) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        """(the checkpoint's trainspec state, this rank's residuals by parameter name), as of
        this step boundary."""
        state: dict[str, Any] = {"version": VERSION}
        tensors: dict[str, torch.Tensor] = {}
        if self.hook is not None:
            state["compression"] = {
                "level": self.hook.next_level,
                "configured": self.configured_level,
            }
            names = {id(p): n for n, p in self._parameters().items()}
            pieces = self.feedback.error_feedback() if self.feedback is not None else {}
            tensors = {names[pid]: t for pid, t in pieces.items() if pid in names}
            if len(tensors) < len(pieces):  # not this model's parameters: nothing to name them
                log.warning("trainspec: %d error-feedback pieces not saved: not parameters of "
                            "the model given to actuate()", len(pieces) - len(tensors))  # fmt: skip
            state["error_feedback"] = {"parameters": len(tensors)}
        plan = self.plan
        state["micro_batch"] = {
            "limit": plan.limit,
            "oom_at": plan.oom_at,
            "configured": plan.configured,
        }
        if self.controller is not None:
            state["controller"] = controller_state(self.controller)
            state[EPISODE_KEY] = episode_state(self.controller)
        return {STATE_KEY: state}, tensors

    def _parameters(self) -> dict[str, torch.Tensor]:
        return dict(self.model.named_parameters()) if self.model is not None else {}

    # ---- restoring ----------------------------------------------------------------------
    def restore(self, trainspec_state: Any, ckpt_dir: Path) -> dict[str, Any]:
        """Put the state saved in `ckpt_dir` back, on every rank alike (collective). Returns
        what was restored and what was not, and why (the `resumed` event's evidence).
        Raises CheckpointError on every rank when any rank's state is malformed."""
        problem, saved, pieces = None, None, {}
        try:
            saved = parse(trainspec_state)
            if saved is not None:
                pieces = self._pieces(saved, rank_tensors.read(ckpt_dir, self.rank))
                if self.controller is not None and saved.controller is not None:
                    check_controller_state(self.controller, saved.controller)
                if self.controller is not None and saved.episode is not None:
                    check_episode_state(self.controller, saved.episode)
        except (CheckpointError, StateError) as exc:
            problem = f"{STATE_KEY}.{exc}" if isinstance(exc, StateError) else str(exc)
        except Exception as exc:  # any other failure is this rank's verdict too: every rank
            # must reach the gather, or the others wait out the control group's timeout
            problem = f"{STATE_KEY}: {type(exc).__name__}: {exc}"[:500]
        verdicts = self._gather((problem, saved.shared() if saved is not None else None))
        errors = [f"rank {r}: {p}" for r, (p, _) in enumerate(verdicts) if p]
        absent = [r for r, (_, shared) in enumerate(verdicts) if shared is None]
        if absent and len(absent) < len(verdicts):
            errors.append(f"ranks {absent} saved no actuator state, the others did")
        if errors:
            raise CheckpointError(
                f"the actuator state in {ckpt_dir} cannot be restored: {'; '.join(errors)}"
            )
        shared = verdicts[0][1]
        if self.switched_off:
            return self._restore_switched_off(saved, pieces)
        if saved is None or shared is None:
            return {"restored": False, "why": "the checkpoint holds no actuator state "
                    "(written before it was saved): compression level and micro-batch as "
                    "configured"}  # fmt: skip
        if shared != saved.shared():
            log.warning("trainspec: rank %d saved another level or controller state than rank 0;"
                        " rank 0's is used on every rank", self.rank)  # fmt: skip
        return {
            "restored": True,
            "compression": self._restore_level(shared["level"], shared["configured_level"]),
            "micro_batch": self._restore_limit(saved),
            "controller": self._restore_controller(shared["controller"]),
            EPISODE_KEY: self._restore_episode(shared["episode"]),
            "error_feedback": self._restore_feedback(pieces),
        }

    def _restore_switched_off(
        self, saved: SavedState | None, pieces: dict[int, torch.Tensor]
    ) -> dict[str, Any]:
        """The actuator is off: none of the checkpoint's plan comes back (shares, level,
        micro-batch limit and OOM size), so the job runs as a fresh one with the actuator off
        would; the sampler's position and the error feedback still do. One warning."""
        dropped: list[str] = []
        out: dict[str, Any] = {"restored": False, "why": "the actuator is off in this job: "
                               "the checkpoint's plan is not restored"}  # fmt: skip
        sampler = self.sampler
        if sampler is not None:
            saved_shares, equal = list(sampler.shares), list(sampler.equal_shares())
            out["shares"] = {"saved": saved_shares, "shares": equal}
            if saved_shares != equal:
                sampler.set_shares(equal)
                if self.hook is not None:
                    self.hook.set_shares(equal[self.rank], sampler.global_batch)
                dropped.append(f"shares {saved_shares} (now {equal})")
        else:  # built without it (by hand): the checkpointer restored its shares as saved
            out["shares"] = {"why": "no sampler given to the actuator state: as saved"}
        if saved is not None:
            level = self.hook.next_level if self.hook is not None else None
            out["compression"] = {"restored": False, "saved": saved.level, "level": level}
            if saved.level is not None and self.hook is not None and saved.level != level:
                dropped.append(f"compression level {saved.level} (now {level})")
            plan = self.plan
            out["micro_batch"] = {"restored": False, "saved": saved.limit,
                                  "oom_at": saved.oom_at, "limit": plan.limit}  # fmt: skip
            if saved.limit is not None and saved.limit != plan.limit:
                dropped.append(f"micro-batch limit {saved.limit} (now {plan.limit})")
            if saved.oom_at:
                dropped.append(f"out-of-memory size {saved.oom_at}")
            out["error_feedback"] = self._restore_feedback(pieces)
        if dropped and self.rank == 0:
            log.warning("trainspec: the actuator is off: the checkpoint's plan is not restored "
                        "(%s); the job runs as configured, on equal shares, from the "
                        "checkpoint's position", "; ".join(dropped))  # fmt: skip
        out["not_restored"] = dropped
        return out

    def _pieces(
        self, saved: SavedState, tensors: dict[str, torch.Tensor]
    ) -> dict[int, torch.Tensor]:
        """The residual pieces by id(parameter) on the parameters' devices; CheckpointError
        for a piece that fits no parameter of the model."""
        if len(tensors) != saved.error_feedback:
            raise CheckpointError(
                f"{STATE_KEY}.error_feedback.parameters is {saved.error_feedback}, but rank "
                f"{self.rank}'s tensor file holds {len(tensors)}"
            )
        params = self._parameters()
        pieces: dict[int, torch.Tensor] = {}
        for name, t in tensors.items():
            p = params.get(name)
            if p is None:
                raise CheckpointError(f"error feedback for {name}: the model has no such parameter")
            real = 2 * p.numel() if p.is_complex() else p.numel()  # DDP sums the real view
            if not t.is_floating_point() or t.numel() != real:
                raise CheckpointError(
                    f"error feedback for {name}: {t.numel()} {t.dtype} values, the parameter "
                    f"has {real}"
                )
            piece = t.reshape(-1).to(device=p.device, dtype=torch.float32)
            if saved.version < 2:  # saved in the bucket's memory order, as DDP lays it out
                piece = logical_piece(piece, layout_of([p])[0])
            pieces[id(p)] = piece
        return pieces

    def _gather(self, verdict: tuple[str | None, Any]) -> list[tuple[str | None, Any]]:
        if self.group is None:
            return [verdict]
        import torch.distributed as dist

        out: list[Any] = [None] * dist.get_world_size(self.group)
        try:
            dist.all_gather_object(out, verdict, group=self.group)
        except Exception as exc:  # a lost rank: the state cannot be agreed on
            raise CheckpointError(
                f"the ranks could not agree on the actuator state: {exc}"
            ) from exc
        return out

    def _restore_level(self, level: str | None, configured_then: str | None) -> dict[str, Any]:
        if level is None:
            return {"restored": False, "why": "not saved"}
        if self.hook is None:
            return {"restored": False, "saved": level, "why": "no gradient hook in this job"}
        if configured_then != self.configured_level:
            return {"restored": False, "saved": level, "level": self.hook.next_level,
                    "why": f"kernels.compression is {self.configured_level}, was "
                    f"{configured_then} at the save: the configuration wins"}  # fmt: skip
        at = self.hook.step
        self.hook.set_level(level, at_step=at)  # every rank: rank 0's level, the same step
        return {"restored": True, "level": level, "from_hook_step": at}

    def _restore_limit(self, saved: SavedState) -> dict[str, Any]:
        plan = self.plan
        why = _limit_kept_because(saved, plan)
        if why is not None or saved.limit is None:
            return {"restored": False, "limit": plan.limit, "saved": saved.limit, "why": why}
        plan.set_limit(saved.limit)
        plan.oom_at = saved.oom_at
        return {"restored": True, "limit": plan.limit, "oom_at": plan.oom_at}

    def _restore_controller(self, state: dict[str, Any] | None) -> dict[str, Any]:
        if state is None:
            return {"restored": [], "why": "not saved"}
        if self.controller is None:
            return {"restored": [], "why": "the actuator is off in this job"}
        return {"restored": load_controller_state(self.controller, state)}

    def _restore_episode(self, state: dict[str, Any] | None) -> dict[str, Any]:
        if state is None:
            return {"restored": [], "why": "not saved: the loss reference is measured afresh"}
        if self.controller is None:
            return {"restored": [], "why": "the actuator is off in this job"}
        return load_episode_state(self.controller, state)

    def _restore_feedback(self, pieces: dict[int, torch.Tensor]) -> dict[str, Any]:
        if self.feedback is None:
            return {"parameters": 0, "why": "no gradient hook in this job"}
        self.feedback.restore_error_feedback(pieces)
        return {"parameters": len(pieces)}
