"""`trainspec demo`: train the reference GPT under torchrun with trainspec, then validate it.

The job runs as a child process (torchrun, N ranks, gloo on CPU or NCCL on CUDA). While it
trains, the progress bar reads the live run store, as any reader would; afterwards the run
is validated, compacted, summarised per rank, and the dashboard command is printed.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from trainspec.cli.child import exit_status, forwarding_signals
from trainspec.cli.main import CliError
from trainspec.cli.run import (
    check_ports_free,
    checked_config,
    make_runs_root,
    port_number,
    runs_root,
)

DEVICES = ("auto", "cpu", "cuda")


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--ranks", type=int, default=2, help="ranks (processes), default 2")
    parser.add_argument("--steps", type=int, default=200, help="optimizer steps, default 200")
    parser.add_argument("--out", type=runs_root, default="runs", help="runs root, default ./runs")
    parser.add_argument("--batch-size", type=int, default=16, help="samples per rank per step")
    parser.add_argument("--device", choices=DEVICES, default="auto", help="default auto")
    parser.add_argument(
        "--prometheus-port", type=port_number, default=0, help="serve /metrics from this base port"
    )
    parser.add_argument(
        "--timeout", type=float, default=1800.0, help="give up after this many seconds"
    )


def _check_cuda(ranks: int) -> None:
    """Rank r trains on cuda:r (train_gpt.py): each needs its device."""
    import torch

    if not torch.cuda.is_available():
        raise CliError("--device cuda: CUDA is not available (use --device cpu or auto)")
    if ranks > torch.cuda.device_count():
        raise CliError(
            f"--device cuda: --ranks {ranks} needs {ranks} GPUs, "
            f"{torch.cuda.device_count()} visible"
        )


def _script() -> Path:
    from trainspec.workload import train_gpt

    return Path(train_gpt.__file__)


def _steps_stored(run_dir: Path) -> int:
    """Rank 0's steps in the run store so far; 0 before it has any."""
    from trainspec.store import query

    try:
        if (run_dir / "segments").is_dir():
            t = query(run_dir, "SELECT coalesce(max(step) + 1, 0) AS n FROM steps WHERE rank = 0")
            return int(t.column(0)[0].as_py() or 0)
    except Exception:  # the store is being written: try again next tick
        pass
    return 0


def _kept(run_dir: Path) -> str:
    """What a demo stopped before its end leaves behind, and where."""
    if not run_dir.is_dir():
        return "nothing was stored yet"
    steps = _steps_stored(run_dir)
    if not steps:
        return f"no step was stored yet; what was is kept in {run_dir}"
    return f"the {steps} steps stored so far are kept in {run_dir}"


def _progress(run_dir: Path, steps: int, started: float) -> str:
    done = _steps_stored(run_dir)
    width = 30
    filled = int(width * min(done, steps) / max(steps, 1))
    return f"\r  training [{'#' * filled}{'.' * (width - filled)}] {done}/{steps} steps  {time.time() - started:5.0f}s"


MAX_RANKS = 256


def _check_before_launch(args: argparse.Namespace) -> None:
    """Raise CliError for what would otherwise fail in every rank, behind torchrun's report."""
    if args.ranks < 1 or args.steps < 1 or args.batch_size < 1:
        raise CliError("--ranks, --steps and --batch-size must be at least 1")
    if args.ranks > MAX_RANKS:  # one machine: torchrun grew past a GB on 10^20 before failing
        raise CliError(f"--ranks {args.ranks}: the demo runs on one machine, at most {MAX_RANKS}")
    if not args.timeout > 0:  # NaN too: it would never time out
        raise CliError(f"--timeout {args.timeout:g}: must be a positive number of seconds")
    cfg = checked_config()  # each rank loads it: a bad file is one line here, not N tracebacks
    _check_inject()
    # the flag, else collector.prometheus_port from the file or TRAINSPEC_*: the ranks' base
    base = args.prometheus_port or cfg.collector.prometheus_port
    name = "--prometheus-port" if args.prometheus_port else "collector.prometheus_port"
    if base and base + args.ranks - 1 > 65535:
        raise CliError(f"{name} {base}: rank ports reach {base + args.ranks - 1} > 65535")
    if args.device == "cuda":
        _check_cuda(args.ranks)
    if base:  # one node: the ranks' local ranks are 0 .. ranks - 1
        check_ports_free(cfg.collector.prometheus_addr, base, args.ranks)


def _check_inject() -> None:
    """Every rank parses TRAINSPEC_INJECT (and checks its opt-in) and exits on a bad one:
    the same parse here, before launching, is one line instead of torchrun's failure dump."""
    from trainspec.runtime.inject import ENV_SPEC, FaultPlan, InjectionNotAllowedError

    try:
        FaultPlan.from_env(os.environ)
    except InjectionNotAllowedError as exc:
        raise CliError(str(exc)) from None
    except ValueError as exc:  # InjectSpecError
        raise CliError(f"{ENV_SPEC}: {exc}") from None


def run(args: argparse.Namespace) -> int:
    from trainspec.runtime.identity import new_run_id

    _check_before_launch(args)
    out = make_runs_root(Path(args.out), "--out")
    run_id = new_run_id()
    run_dir = out / run_id
    log_path = out / f"{run_id}.log"
    env = dict(os.environ)
    env.update(
        TRAINSPEC_STORE_RUN_ID=run_id,
        TRAINSPEC_STORE_ROOT=str(out),
        OMP_NUM_THREADS=env.get("OMP_NUM_THREADS", "1"),
    )
    if args.prometheus_port:
        env["TRAINSPEC_COLLECTOR_PROMETHEUS_PORT"] = str(args.prometheus_port)
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        f"--nproc-per-node={args.ranks}", str(_script()),
        f"--steps={args.steps}", f"--batch-size={args.batch_size}", f"--device={args.device}",
    ]  # fmt: skip
    print(
        f"trainspec demo: run {run_id}: {args.ranks} ranks x {args.steps} steps (log: {log_path})"
    )
    started = time.time()
    interactive = sys.stdout.isatty()  # a log file gets a line every 15 s, not a stream of \r
    with open(log_path, "w") as log, _interrupting_once() as ignore_interrupts:
        launch = lambda: subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)  # noqa: E731
        with forwarding_signals(launch) as proc:
            try:
                while proc.poll() is None:
                    if time.time() - started > args.timeout:
                        ignore_interrupts()  # a Ctrl-C now would cut the stopping short
                        _stop(proc)
                        raise CliError(
                            f"training did not finish in {args.timeout:g}s; stopped it; "
                            f"{_kept(run_dir)} (log: {log_path})"
                        )
                    if interactive or int(time.time() - started) % 15 == 0:
                        line = _progress(run_dir, args.steps, started)
                        print(
                            line if interactive else line.lstrip("\r"),
                            end="" if interactive else "\n",
                            flush=True,
                        )
                    time.sleep(1.0)
            except KeyboardInterrupt:  # further ones are ignored (`_interrupting_once`)
                _stop(proc)
                # on a line of its own (the progress line has none yet), saying what is kept
                print(f"\ntrainspec demo: interrupted; {_kept(run_dir)}", file=sys.stderr)
                raise  # exit 130 (`main`)
    print(_progress(run_dir, args.steps, started).lstrip("\r"))
    if proc.returncode != 0:
        tail = log_path.read_text().splitlines()[-15:]
        print("\n".join(tail), file=sys.stderr)
        status = exit_status(proc.returncode)
        raise CliError(f"training failed (exit {status}); full log in {log_path}")
    return _report(run_dir, out)


STOP_WAIT_S = 30.0


def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM to torchrun, which stops its ranks (they flush what they hold); SIGKILL if it
    is not gone in STOP_WAIT_S. Waiting alone ended the demo in an unexpected TimeoutExpired,
    torchrun still running, and no word of what was kept."""
    proc.terminate()
    try:
        proc.wait(STOP_WAIT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@contextlib.contextmanager
def _interrupting_once() -> Iterator[Callable[[], None]]:
    """While the block runs, the first SIGINT raises KeyboardInterrupt, as Python's own
    handler does, and any after it is ignored: a second Ctrl-C raised inside the stopping of
    the job, which was left unwaited for, and the line saying what was kept never came.
    Yields a function that ignores SIGINT from then on (a timeout's stop). Off the main
    thread, where Python allows no handlers, or where it was ignored already (`nohup`, a
    shell's background job), SIGINT is left as it is."""

    def ignore() -> None:
        signal.signal(signal.SIGINT, signal.SIG_IGN)

    def first(_signum: int, _frame: object) -> None:
        ignore()  # before raising: no moment in which a second one raises again
        raise KeyboardInterrupt

    if (
        threading.current_thread() is not threading.main_thread()
        or signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    ):
        yield lambda: None
        return
    previous = signal.signal(signal.SIGINT, first)
    try:
        yield ignore
    finally:  # None: a handler set outside Python, not restorable; Python's default then
        signal.signal(signal.SIGINT, signal.default_int_handler if previous is None else previous)


def _report(run_dir: Path, out: Path) -> int:
    from trainspec.cli.output import render_text
    from trainspec.cli.summary import run_summary
    from trainspec.store import StoreError, compact

    print("\nper-rank summary")
    print(render_text(run_summary(run_dir)))
    verdict = _validate(run_dir)
    try:
        target = compact(run_dir)
    except StoreError as exc:  # a full disk, say: foreseen, so one line, not a traceback
        raise CliError(f"{exc} (the run stays readable, uncompacted)") from exc
    print(f"\nrun store: {run_dir} (compacted: {target})")
    # quoted for a shell: `--out "my runs"` printed commands that ran as two arguments
    print(f'query it:  trainspec query {shlex.quote(str(run_dir))} "SELECT * FROM steps LIMIT 5"')
    print(f"dashboard: trainspec dashboard {shlex.quote(str(out))}")
    return verdict


def _validate(run_dir: Path) -> int:
    try:
        from trainspec.store.compliance import validate_target
    except ImportError:
        print("\nvalidation: validator not installed")
        return 1
    report = validate_target(str(run_dir))
    print("\n" + report.render_text())
    return 0 if report.compliant else 1
