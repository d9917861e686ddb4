"""The wrappers `runtime/auto.py` puts on the process's way out: `sys.excepthook` (an
exception the script did not catch), `sys.exit` and the `exit()` builtin (a failing exit
code), and `os._exit` (no atexit handler runs after it), each telling the zero-code layer
before the original runs."""

from __future__ import annotations

import contextlib
import functools
import signal
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from trainspec.runtime.auto_containment import contained

if TYPE_CHECKING:
    from trainspec.runtime.auto_instrumentation import AutoInstrumentation


def _excepthook(auto: AutoInstrumentation, previous: Any) -> Any:
    """`sys.excepthook`, telling the layer of the script's uncaught exception (`on_uncaught`)
    before the hook it replaces prints it."""

    def excepthook(kind: type[BaseException], exc: BaseException, tb: Any) -> None:
        contained(auto, auto.on_uncaught, exc)
        previous(kind, exc, tb)

    return excepthook


def _exit_watched(auto: AutoInstrumentation, original: Any) -> Any:
    """`sys.exit` (or the `exit()` builtin's call), marking the `SystemExit` it raises so
    that one leaving the script is seen at exit (`ExitStatus.watch`); raised as it was."""

    @functools.wraps(original)
    def exit(*args: Any, **kwargs: Any) -> Any:
        try:
            return original(*args, **kwargs)
        except SystemExit as exc:  # (unbound at the block's end: no cycle keeps it alive)
            contained(auto, auto.exits.watch, exc)
            raise

    return exit


# The longest `os._exit` waits for the layer to record and flush: telemetry never holds the
# exit (a flush stuck on a full disk, or on a lock the caller of `os._exit` holds).
OS_EXIT_WAIT_S = 3.0


def _os_exit_watched(
    auto: AutoInstrumentation, original: Any, *, wait_s: float = OS_EXIT_WAIT_S
) -> Any:
    """`os._exit(code)`: the process ends with no atexit handler, so the session was never
    closed (its last flush's steps lost, a failing code on no record). In the process whose
    session it is (`owns_session`: not a DataLoader worker forked from it, which ends in
    `os._exit` too), the layer records the exit and closes the session (`on_os_exit`) on a
    thread of its own, waited for `wait_s` at most, SIGTERM ignored meanwhile; then the real
    `os._exit(code)`."""

    @functools.wraps(original)
    def _exit(code: int) -> None:
        if auto.owns_session:
            _finish_within(auto, code, wait_s)
        original(code)

    return _exit


def _finish_within(auto: AutoInstrumentation, code: int, wait_s: float) -> None:
    """`auto.on_os_exit(code)`, contained, waited for `wait_s` at most. On a thread of its
    own: `os._exit` may be called where the caller holds a lock the flush needs (a signal
    handler's), and the wait must end all the same."""
    finishing = threading.Thread(
        target=contained, args=(auto, auto.on_os_exit, code, wait_s),
        name="trainspec-os-exit", daemon=True,
    )  # fmt: skip
    with _sigterm_ignored():
        try:
            finishing.start()
        except RuntimeError:  # no new thread at interpreter shutdown: the exit goes on
            auto.failures += 1
            return
        finishing.join(wait_s)


@contextlib.contextmanager
def _sigterm_ignored() -> Iterator[None]:
    """SIGTERM ignored while the process, already on its way out, waits for its flush (on
    the main thread, where Python sets handlers). torchrun sends it to every other rank as
    soon as one has exited: trainspec's own handler then found the session closing, and
    ended the rank by SIGTERM in the middle of its flush, its steps and its exit code lost."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    try:
        previous = signal.signal(signal.SIGTERM, signal.SIG_IGN)
    except (ValueError, OSError):  # not settable here: the wait goes on as it is
        yield
        return
    try:
        yield
    finally:
        if previous is not None:  # None: a handler set outside Python, not restorable
            signal.signal(signal.SIGTERM, previous)
