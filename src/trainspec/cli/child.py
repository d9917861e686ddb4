"""The job a CLI command launches: signals passed on to it, its exit status kept.

`trainspec run` and `trainspec demo` sit between a process manager and torchrun. A SIGTERM
sent to them alone (Kubernetes stops a pod by signalling its PID 1) left torchrun and its
ranks training as orphans; a job killed by a signal came back as a negative status that
`sys.exit` turned into 247 instead of the shell's 128 + N.
"""

from __future__ import annotations

import contextlib
import signal
import subprocess
import threading
from collections.abc import Callable, Iterator

FORWARDED = tuple(
    sig for sig in (getattr(signal, "SIGTERM", None), getattr(signal, "SIGHUP", None)) if sig
)


@contextlib.contextmanager
def forwarding_signals(
    start: Callable[[], subprocess.Popen], *, ignore_interrupt: bool = False
) -> Iterator[subprocess.Popen]:
    """Start the job with `start()` and, while the block runs, pass SIGTERM and SIGHUP sent
    to this process on to it. The forwarders are in place before the job starts, so a
    signal in between is not lost with the job orphaned. With `ignore_interrupt`, SIGINT is
    left to the job: a terminal's Ctrl-C reaches the whole foreground group, the job
    included, and the job's own shutdown is waited for rather than cut short (a SIGINT
    sent to this process alone is then not passed on). Off the main thread, where Python
    allows no handlers, the job runs without them."""
    proc: subprocess.Popen | None = None

    def forward(signum: int, _frame: object) -> None:
        if proc is not None:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signum)

    main_thread = threading.current_thread() is threading.main_thread()
    previous = {sig: signal.signal(sig, forward) for sig in FORWARDED} if main_thread else {}
    try:
        proc = start()
        if ignore_interrupt and main_thread:
            previous[signal.SIGINT] = signal.signal(signal.SIGINT, signal.SIG_IGN)
        yield proc
    finally:
        for sig, handler in previous.items():
            if handler is not None:  # None: a handler set outside Python, not restorable
                signal.signal(sig, handler)


def exit_status(returncode: int) -> int:
    """A child's status as a shell reports it: 128 + N for one killed by signal N."""
    return 128 - returncode if returncode < 0 else returncode


def run_job(command: list[str], env: dict[str, str]) -> int:
    """Run `command` to its end with signals forwarded; its exit status (OSError if it
    cannot be started)."""
    with forwarding_signals(
        lambda: subprocess.Popen(command, env=env), ignore_interrupt=True
    ) as proc:
        return exit_status(proc.wait())
