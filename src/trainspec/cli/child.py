"""The job a CLI command launches: signals passed on to it, its exit status kept.

`trainspec run` and `trainspec demo` sit between a process manager and torchrun. A SIGTERM
sent to them alone (Kubernetes stops a pod by signalling its PID 1) left torchrun and its
ranks training as orphans; a job killed by a signal came back as a negative status that
`sys.exit` turned into 247 instead of the shell's 128 + N. `trainspec run` passes SIGINT on
too, as torchrun does to its workers, unless the job got it from the terminal already.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading
from collections.abc import Callable, Iterator

FORWARDED = tuple(
    sig for sig in (getattr(signal, "SIGTERM", None), getattr(signal, "SIGHUP", None)) if sig
)


@contextlib.contextmanager
def forwarding_signals(
    start: Callable[[], subprocess.Popen], *, forward_interrupt: bool = False
) -> Iterator[subprocess.Popen]:
    """Start the job with `start()` and, while the block runs, pass SIGTERM and SIGHUP sent
    to this process on to it. The forwarders are in place before the job starts, and a
    signal that comes before `start()` returns is passed on once it has, so the job is
    neither orphaned nor left running. With `forward_interrupt`, SIGINT is passed on as
    well (a Ctrl-C sent to this process alone left the job training), and this process
    waits for the job's own shutdown instead of raising KeyboardInterrupt; except the
    terminal's Ctrl-C, which the job, in the same foreground group, got itself
    (`_job_got_the_terminal_s`). Off the main thread, where Python allows no handlers, the
    job runs without them."""
    proc: subprocess.Popen | None = None
    early: list[int] = []  # signals that came while the job was being started

    def forward(signum: int, _frame: object) -> None:
        if proc is None:
            early.append(signum)
        else:
            pass_on(proc, signum)

    signals = FORWARDED + ((signal.SIGINT,) if forward_interrupt else ())
    main_thread = threading.current_thread() is threading.main_thread()
    # A handler (unlike SIG_IGN) is reset to the default in the job at exec: it inherits none.
    previous = {sig: signal.signal(sig, forward) for sig in signals} if main_thread else {}
    try:
        proc = start()
        for signum in early:
            pass_on(proc, signum)
        yield proc
    finally:
        for sig, handler in previous.items():
            if handler is not None:  # None: a handler set outside Python, not restorable
                signal.signal(sig, handler)


def pass_on(proc: subprocess.Popen, signum: int) -> None:
    """Send `signum` to the job, unless it is a SIGINT the job got from the terminal."""
    if signum == signal.SIGINT and _job_got_the_terminal_s(proc.pid):
        return
    with contextlib.suppress(ProcessLookupError):
        proc.send_signal(signum)


def _job_got_the_terminal_s(pid: int) -> bool:
    """Whether a SIGINT is most likely the terminal's Ctrl-C, which reached the job as well:
    the job is in this process's group, the terminal's foreground group. Passed on, it
    would reach torchrun twice, and a second SIGINT raises inside torchrun's shutdown,
    which starts over with SIGTERM to the workers (torch/distributed/elastic/agent/server/
    api.py: `run`). torchrun puts its workers in sessions of their own, so they get the
    signal once, from torchrun."""
    try:
        if os.getpgid(pid) != os.getpgrp():
            return False
        tty = os.open("/dev/tty", os.O_RDONLY | os.O_NOCTTY)  # fails without a terminal
    except (OSError, AttributeError):  # no such process any more; no terminal; not POSIX
        return False
    try:
        return os.tcgetpgrp(tty) == os.getpgrp()
    except OSError:
        return False
    finally:
        os.close(tty)


def exit_status(returncode: int) -> int:
    """A child's status as a shell reports it: 128 + N for one killed by signal N."""
    return 128 - returncode if returncode < 0 else returncode


def run_job(command: list[str], env: dict[str, str]) -> int:
    """Run `command` to its end with signals forwarded (SIGINT too); its exit status
    (OSError if it cannot be started)."""
    with forwarding_signals(
        lambda: subprocess.Popen(command, env=env), forward_interrupt=True
    ) as proc:
        return exit_status(proc.wait())
