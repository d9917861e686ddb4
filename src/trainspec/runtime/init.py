"""`trainspec.init()`: set up one rank's collector, side groups and shutdown handling."""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import signal
import threading
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

from trainspec.collector import Collector
from trainspec.collector.sampler import Sampler
from trainspec.collector.samplers.telemetry import TelemetrySampler
from trainspec.collector.sink import Sink
from trainspec.collector.sinks.store import StoreSink
from trainspec.config import TrainspecConfig, load_config
from trainspec.levels import LEVEL_RULES
from trainspec.runtime import arguments, loss_scale
from trainspec.runtime.groups import (
    create_side_groups,
    default_group_timeout_s,
    side_group_timeout_s,
)
from trainspec.runtime.identity import (
    RankIdentity,
    identity_from_env,
    new_run_id,
    restart_count,
    run_id_from_env,
)
from trainspec.runtime.process_group import init_default_group
from trainspec.runtime.rank_terms import Agreement, Terms, agree
from trainspec.runtime.run_note import note_run_dir
from trainspec.runtime.session import Session
from trainspec.runtime.step_timer import CudaPhaseClock, HostPhaseClock
from trainspec.runtime.wiring import build_samplers, build_sinks, run_row
from trainspec.store.errors import StoreError, first_line
from trainspec.store.layout import check_run_id, holds_writer

log = logging.getLogger("trainspec.runtime")
_current: Session | None = None


def current() -> Session | None:
    """The session `init` made in this process, if any."""
    return _current


def _ensure_process_group(world_size: int, cuda: bool, timeout_s: float) -> None:
    import torch.distributed as dist

    if world_size > 1 and not dist.is_initialized():
        init_default_group("nccl" if cuda else "gloo", timeout=timedelta(seconds=timeout_s))


def checked_device(device: Any) -> Any:
    """`device` as a torch.device (None for None); a one-line error naming `device` for one
    that is none, or a CUDA device on a machine without CUDA (torch said neither in its own
    words)."""
    if device is None:
        return None
    import torch

    if isinstance(device, bool) or not isinstance(device, (str, int, torch.device)):
        kind = type(device).__name__
        raise TypeError(f"device must be a string, an index or a torch.device, not {kind}")
    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError) as exc:
        reason = first_line(exc)
        raise ValueError(f"device {device!r} is not a device: {reason}") from exc
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r}: CUDA is not available on this machine")
    return dev


def _run_id_from(*candidates: str | None) -> str | None:
    """The first usable run id of the environment's (TRAINSPEC_STORE_RUN_ID, else torchrun's
    rendezvous id) and the configuration's, in that order; one that is no directory name is
    passed over with a warning (never stops the job), so a bad variable falls back to the
    file's id, as `load_config` said it would."""
    for candidate in candidates:
        if not candidate:
            continue
        try:
            return check_run_id(candidate)
        except ValueError as exc:
            log.warning("trainspec: %s (TRAINSPEC_STORE_RUN_ID or store.run_id); passed over", exc)
    return None


def init(
    *,
    run_root: str | Path | None = None,
    run_id: str | None = None,
    config: TrainspecConfig | None = None,
    device: Any = None,
    service_name: str | None = None,
    flops_per_sample: float = 0.0,
    process_group_timeout_s: float = 300.0,
    create_process_group: bool = True,
) -> Session:
    """Start trainspec on this rank and return its Session (the running one if this
    process has one that is not closed).

    Reads RANK / LOCAL_RANK / WORLD_SIZE from torchrun's environment and initializes the
    default process group (NCCL on CUDA, gloo on CPU) if the script has not, unless
    `create_process_group` is False: then a job whose ranks never form a group has each rank
    measured on its own (no latency probe, no actuator). Errors in
    telemetry set-up other than bad arguments are logged and leave a session that still
    times steps; training is never stopped by telemetry.
    """
    global _current
    import torch

    from trainspec.runtime.auto import installed as zero_code

    auto = zero_code()
    if auto is not None and not auto.starting:  # the script's own call under `trainspec run`
        auto.stand_down()
        if _current is not None and not _current.closed and auto.session is _current:
            # Started at the script's process group: the script's now, with what of its
            # arguments can still apply.
            return _adopt(_current, config, device, flops_per_sample, run_root, run_id)
    if _current is not None and not _current.closed:
        # A second session would write as the same rank under the same writer id, and its
        # threads would double every sample: one per process (`trainspec run` has already
        # made it when the script's own `init` runs).
        log.warning(
            "trainspec: init called again in this process; returning the running session "
            "(run %s); close it first for a new one",
            _current.run_id,
        )
        return _current
    flops_per_sample = arguments.non_negative_number("flops_per_sample", flops_per_sample)
    loss_scale.install()  # gradient statistics in the gradient's units under a GradScaler
    process_group_timeout_s = arguments.positive_seconds(
        "process_group_timeout_s", process_group_timeout_s
    )
    if config is not None and not isinstance(config, TrainspecConfig):
        raise TypeError(
            f"config must be a TrainspecConfig (trainspec.config.load_config(overrides=...)), "
            f"not {type(config).__name__}"
        )
    if run_id is not None:
        check_run_id(run_id)  # a bad argument is the caller's error
    if run_root is not None and not isinstance(run_root, (str, os.PathLike)):
        raise TypeError(f"run_root must be a path, not {type(run_root).__name__}")
    dev = checked_device(device)
    cfg = config or load_config(extra_rules=LEVEL_RULES)
    ident = identity_from_env()
    cuda = dev is not None and dev.type == "cuda"
    if cuda and not cfg.collector.peak_flops:
        from trainspec.collector.peak_flops import peak_flops_for

        cfg.collector.peak_flops = peak_flops_for(torch.cuda.get_device_name(dev)) or 0.0
    if create_process_group:
        _ensure_process_group(ident.world_size, cuda, process_group_timeout_s)
    training_timeout_s = default_group_timeout_s(process_group_timeout_s)
    groups = create_side_groups(timeout_s=side_group_timeout_s(training_timeout_s))
    ident = _identity_from_group(ident, groups)
    rid = run_id or _run_id_from(run_id_from_env(), cfg.store.run_id)
    mine = Terms.of(cfg, rid or new_run_id(), os.path.abspath(run_root or cfg.store.root))
    if groups is not None:  # rank 0's run id on every rank: one given per rank split the run
        terms = agree(mine, groups.control, ident.rank, ident.world_size)
        if rid is not None and terms.run_id != rid:
            log.warning("trainspec: rank %d was given run id %s; every rank writes rank 0's, %s",
                        ident.rank, rid, terms.run_id)  # fmt: skip
    else:
        terms = Agreement.alone(mine)
    rid = terms.run_id
    cfg = terms.applied_to(cfg)
    run_dir = Path(run_root or cfg.store.root) / rid
    _warn_if_reused(run_dir, rid, ident)
    service = service_name or os.environ.get("OTEL_SERVICE_NAME", "trainspec")
    resource = ident.resource(rid, service)
    clock = CudaPhaseClock(dev) if cuda else HostPhaseClock()
    collector = None
    probe = None
    if cfg.collector.enabled:
        try:
            collector, probe = _build_collector(cfg, ident, rid, run_dir, resource, cuda, groups)
        except Exception as exc:  # noqa: BLE001 - telemetry never stops the job
            log.warning("trainspec: collector off (training goes on): %s", exc)
    session = Session(
        config=cfg,
        identity=ident,
        run_id=rid,
        run_dir=run_dir,
        collector=collector,
        groups=groups,
        clock=clock,
        flops_per_sample=flops_per_sample,
        probe=probe,
        hooks_gradients=terms.hook,
        operator_actions=terms.operator_actions,
    )
    _install_shutdown(session)
    _register_fork_handler()
    if collector is not None:
        if cfg.collector.gc_freeze:  # before the sampling threads start: a pause of theirs
            _settle_heap()  # was the first gap of every run (validated as a cadence miss)
        try:
            collector.start()
        except Exception as exc:  # noqa: BLE001 - no thread to sample with: steps still go
            log.warning("trainspec: sampling threads not started: %s", exc)
    _current = session
    note_run_dir(run_dir)  # `trainspec run` said where to store; the script chose elsewhere
    return session


def _identity_from_group(ident: RankIdentity, groups: Any) -> RankIdentity:
    """This rank as its process group knows it, when no launcher said (no RANK): the ranks
    of `torch.multiprocessing.spawn` get theirs from the script's `init_process_group(rank=,
    world_size=)`, and were all stored as rank 0 of 1. The local rank (the Prometheus port's
    offset, the GPU sampled) is LOCAL_RANK if set, else this rank's place among the ranks on
    its host (one gather of host names on the control group, every rank at this point)."""
    import torch.distributed as dist

    if "RANK" in os.environ or not dist.is_available() or not dist.is_initialized():
        return ident
    rank, world = dist.get_rank(), dist.get_world_size()
    local = os.environ.get("LOCAL_RANK", "")
    if local.isdigit():
        return RankIdentity(rank, int(local), world, ident.host)
    hosts = [ident.host]
    if groups is not None:
        hosts = [""] * world
        dist.all_gather_object(hosts, ident.host, group=groups.control)
    return RankIdentity(rank, hosts[:rank].count(ident.host), world, ident.host)


def _adopt(
    session: Session,
    config: TrainspecConfig | None,
    device: Any,
    flops_per_sample: float,
    run_root: Any,
    run_id: str | None,
) -> Session:
    """Give the script's `init` arguments to the session `trainspec run` started at its
    process group: FLOPs per sample, the device's clock, and its configuration for what is
    built later (the gradient hook's level, the actuator). The collector already runs with
    the environment's settings, and the run's place is `trainspec run`'s (--out, --run-id)."""

    session.flops_per_sample = arguments.non_negative_number("flops_per_sample", flops_per_sample)
    dev = checked_device(device)
    if dev is not None and dev.type == "cuda":
        session.clock = CudaPhaseClock(dev)
    if config is not None and not isinstance(config, TrainspecConfig):
        raise TypeError(f"config must be a TrainspecConfig, not {type(config).__name__}")
    _settle_again(session, config)
    if run_root is not None or run_id is not None or config is not None:
        log.warning(
            "trainspec: `trainspec run` started this run (%s) at the process group; the "
            "script's run_root/run_id do not move it, and its config applies to the gradient "
            "hook and the actuator, not the collector already running",
            session.run_dir,
        )
    return session


def _settle_again(session: Session, config: TrainspecConfig | None) -> None:
    """The ranks settle again over the script's own `init(config=)` (every rank's script
    makes this call, as it would make init's own gather without `trainspec run`; one given
    no config takes part with the settings it has, silently): a level the script gave one
    rank went straight to its hook, and the job hung (review). A gather that fails leaves
    this rank's settings as they are, with a warning: the script goes on."""
    mine = Terms.of(config or session.config, session.run_id, str(session.run_dir.parent))
    groups, ident = session.groups, session.identity
    try:
        terms = (
            agree(mine, groups.control, ident.rank, ident.world_size, say=config is not None)
            if groups is not None
            else Agreement.alone(mine)
        )
    except Exception as exc:  # noqa: BLE001 - a lost rank: telemetry never stops the script
        log.warning("trainspec: the ranks could not settle the script's settings (%s)", exc)
        terms = Agreement.alone(mine)
    session.config = terms.applied_to(config or session.config)
    session.operator_actions = terms.operator_actions
    if session.hook is not None:  # a DDP model hooked before this call: the agreed level
        from trainspec.kernels.hook import configured_level

        level = str(configured_level(session.config.kernels))
        if session.hook.next_level != level:  # the same level is no switch (codec state kept)
            session.hook.set_level(level)


def _forget_in_child() -> None:
    """A forked child (a worker the script forks itself) inherits the session but not its
    threads: closing it at the child's exit flushed the parent's steps a second time and
    crashed in the store's writer. The child's copy is closed unflushed and forgotten."""
    global _current
    if _current is not None:
        _current.abandon_in_child()
        _current = None


def _build_collector(
    cfg: TrainspecConfig,
    ident: Any,
    rid: str,
    run_dir: Path,
    resource: dict[str, Any],
    cuda: bool,
    groups: Any,
) -> tuple[Collector, Any]:
    """Build the collector (not started); on failure, close what was built, then re-raise."""
    samplers, probe, nvml = build_samplers(cfg, ident, cuda=cuda, groups=groups)
    sinks, store = build_sinks(cfg, ident, run_dir, resource)
    try:
        collector = Collector(
            rank=ident.rank,
            samplers=samplers,
            sinks=sinks,
            flush_interval_s=cfg.store.flush_interval_s,
            capacity=cfg.collector.queue_capacity,
            thread_nice=cfg.collector.thread_nice,
            journal=store.journal if isinstance(store, StoreSink) else None,
        )
        collector.samplers.append(TelemetrySampler(collector.dropped_total))
    except Exception:
        parts: list[Sink | Sampler] = [*sinks, *samplers]
        for part in parts:
            with contextlib.suppress(Exception):
                part.close()
        raise
    if store is not None:
        gpus = [vars(g) for g in nvml.gpus] if nvml is not None else []
        row = run_row(cfg, ident, rid, device="cuda" if cuda else "cpu", gpus=gpus)
        try:
            store.write_run_row(row)
        except StoreError as exc:  # a full or vanished disk: the sink counts what follows
            log.warning("trainspec: the run's description was not stored: %s", exc)
    return collector, probe


_fork_handler_registered = False


def _register_fork_handler() -> None:
    global _fork_handler_registered
    if not _fork_handler_registered and hasattr(os, "register_at_fork"):
        os.register_at_fork(after_in_child=_forget_in_child)
        _fork_handler_registered = True


def _settle_heap() -> None:
    """Pay for one full garbage collection now, at set-up, and freeze the survivors.

    The collector's imports (pyarrow and the pandas it loads, DuckDB, OpenTelemetry) put
    some 270,000 objects on the heap; the cyclic collector's first full pass over them came
    in the middle of training and held the interpreter for 166-190 ms (one step of a zero-
    code DDP run, at step 14 every time). Frozen objects are left out of every later pass;
    reference counting still frees them, only a cycle among them would stay (gc.freeze).
    """
    import gc

    global _frozen
    gc.collect()
    gc.freeze()
    _frozen = True


_frozen = False


def _thaw() -> None:
    """At exit, once the session closed, give the frozen objects back to the collector and
    collect: a cycle among them is then freed before the interpreter tears its modules down,
    as without the freeze (with it, Triton's bindings reported leaked instances at exit).
    After the close, not before: its full pass holds the interpreter for 0.15-0.3 s, a gap
    in every sampler's cadence that failed validation of every run shorter than a second."""
    import gc

    global _frozen
    if not _frozen:
        return
    _frozen = False
    gc.unfreeze()
    gc.collect()


def _off_the_main_thread(work: Callable[[], None], *, timeout_s: float) -> None:
    """Run `work` on a thread of its own and wait at most `timeout_s`. A signal handler runs
    on the main thread between two of its bytecodes: one that flushed there re-entered the
    locks the interrupted code held (a flush, a segment write) and hung the process."""
    thread = threading.Thread(target=work, name="trainspec-signal-flush", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        log.warning("trainspec: the flush at SIGTERM did not finish in %.0f s", timeout_s)


def _close_at_exit(session: Session) -> None:
    try:
        session.close(aligned=False, timeout_s=5.0)
    finally:
        _thaw()


def _install_shutdown(session: Session) -> None:
    """Flush on normal exit and on SIGTERM (preemption, torchrun stopping the group)."""
    atexit.register(_close_at_exit, session)
    try:
        previous = signal.getsignal(signal.SIGTERM)
    except ValueError:  # not the main thread
        return

    def on_sigterm(signum: int, frame: Any) -> None:
        if callable(previous):
            # Someone handles SIGTERM gracefully (a preemption watcher that stops every rank
            # at one step): make what was measured durable, keep measuring, and hand over.
            _off_the_main_thread(session.flush, timeout_s=5.0)
            previous(signum, frame)
            return
        _off_the_main_thread(lambda: session.close(aligned=False, timeout_s=5.0), timeout_s=6.0)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)

    with contextlib.suppress(ValueError):
        signal.signal(signal.SIGTERM, on_sigterm)


def _warn_if_reused(run_dir: Path, rid: str, ident: Any) -> None:
    """A first attempt (not a torchrun restart) finding its rank's rows already in the run
    is another job given the same run id: its rows join the earlier job's, steps counted
    again from 0. Said, not refused: a job resumed from a checkpoint may mean to continue."""
    if restart_count() > 0:
        return  # a restart of this job continues its own run
    try:
        reused = holds_writer(run_dir, ident.writer)
    except OSError:
        return
    if reused:
        log.warning(
            "trainspec: run %s already holds rank %d's rows from an earlier job; this job's "
            "are added to them (a new run id keeps runs apart)",
            rid,
            ident.rank,
        )
