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
from collections.abc import Iterator

FORWARDED = (signal.SIGTERM, signal.SIGHUP)


@contextlib.contextmanager
def forwarding_signals(proc: subprocess.Popen, *, ignore_interrupt: bool = False) -> Iterator[None]:
    """While the block runs, SIGTERM and SIGHUP sent to this process go to `proc`. With
    `ignore_interrupt`, SIGINT is left to the job: a terminal's Ctrl-C reaches the whole
    foreground group, the job included, and the job's own shutdown is then waited for
    rather than cut short."""

    def forward(signum: int, _frame: object) -> None:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signum)

    previous = {sig: signal.signal(sig, forward) for sig in FORWARDED}
    if ignore_interrupt:
        previous[signal.SIGINT] = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def exit_status(returncode: int) -> int:
    """A child's status as a shell reports it: 128 + N for one killed by signal N."""
    return 128 - returncode if returncode < 0 else returncode


def run_job(command: list[str], env: dict[str, str]) -> int:
    """Run `command` to its end with signals forwarded; its exit status (OSError if it
    cannot be started)."""
    proc = subprocess.Popen(command, env=env)
    with forwarding_signals(proc, ignore_interrupt=True):
        return exit_status(proc.wait())
