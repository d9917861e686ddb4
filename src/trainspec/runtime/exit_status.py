"""How this process ends, as far as Python lets it be seen: the zero-code layer's view at exit.

Python tells no atexit handler the status the process exits with, and an exception that
leaves the script reaches `sys.excepthook` only if it is not a `SystemExit` (that one is
handled in C first, `handle_system_exit`), and only the hook the script left in place. What
is seen here, by the time the atexit handlers run:
- an exception that left the script, whoever's `sys.excepthook` printed it: `PyErr_Print`
  sets `sys.last_value` (`sys.last_exc` from 3.12) before it calls the hook, the default or
  one the script installed over trainspec's.
- `sys.exit(code)` (the script's, argparse's, click's) and the `exit()` / `quit()` builtins:
  the `SystemExit` they raise carries a marker (`_LeftTheScript`) that is finalized when the
  exception is freed, at once, by reference count. Freed with no Python frame running, it
  left the script: the interpreter's top level handled it and the process ends with that
  code. Freed inside a frame, a handler caught it (the script goes on, or ends as that
  handler decides): no ending is seen.
Not seen: a `SystemExit` the script raises itself (`raise SystemExit(1)`; nothing in Python
3.11 sees it leave, short of tracing every call; raised in the handler that caught a
`sys.exit(code)`, it is read as that code, its `__context__`), a process killed by a signal,
and a hook or handler that ends the process itself. Those end as they did: the steps over
are stored by the atexit handler, and the step in progress, if any, is dropped unrecorded.
`os._exit` runs no atexit handler at all: the zero-code layer wraps it instead
(`auto_exit_hooks._os_exit_watched`), and a failing code reaches it as a `HardExit`.
"""

from __future__ import annotations

import sys
from typing import Any

_NOT_SEEN = object()


def _last_uncaught() -> BaseException | None:
    """The exception `PyErr_Print` last reported as leaving the script, if any."""
    last = getattr(sys, "last_exc", None) or getattr(sys, "last_value", None)
    return last if isinstance(last, BaseException) else None


def failing(code: Any) -> bool:
    """Whether `sys.exit(code)` ends the process with a failure status (not 0, not None:
    a string or any other object exits with 1)."""
    return code is not None and not (isinstance(code, int) and code == 0)


class HardExit(SystemExit):
    """`os._exit(code)` with a failing code, as the step it ended is failed with: a
    `SystemExit` (severity `warning`, as for `sys.exit(1)`) whose words say which exit it
    was, `HardExit: os._exit(3)`."""

    def __str__(self) -> str:
        return f"os._exit({self.code})"


class ExitStatus:
    """What this process is seen to end on (`ending`). Reading `sys` only: `watch` marks a
    `SystemExit` that `sys.exit` raised, the patched `sys.exit` (`runtime/auto.py`) calls it."""

    def __init__(self) -> None:
        # An exception reported before trainspec started (an interactive session's) is none
        # of this run's.
        self._stale = _last_uncaught()
        self.exit_code: Any = _NOT_SEEN  # the code of a `sys.exit` that left the script

    def watch(self, exc: SystemExit) -> None:
        """`exc`, raised by `sys.exit`, is on its way out: seen if it leaves the script."""
        vars(exc)["_trainspec_exit"] = _LeftTheScript(self, exc.code)

    def ending(self) -> BaseException | None:
        """The failure this process ends on, read at exit: the exception that left the
        script (its `sys.excepthook` called, whoever's it is), or a `SystemExit` for a
        `sys.exit` whose code is a failure (`failing`). None at a normal end, at
        `sys.exit(0)` or `sys.exit()`, and for what is not seen (the module docstring)."""
        last = _last_uncaught()
        if last is not None and last is not self._stale:
            return last
        if self.exit_code is not _NOT_SEEN and failing(self.exit_code):
            return SystemExit(self.exit_code)
        return None


class _LeftTheScript:
    """Rides on a `SystemExit` that `sys.exit` raised; finalized when the exception is
    freed. With no Python frame below the finalizer, the interpreter's top level freed it:
    it left the script, and the process ends with its code. The first so freed is that one:
    an exception's own attributes are freed before its `__context__` (a `sys.exit(0)` in the
    handler that caught a `sys.exit(1)` ended with 0, and was read as 1)."""

    __slots__ = ("code", "status")

    def __init__(self, status: ExitStatus, code: Any) -> None:
        self.status, self.code = status, code

    def __del__(self) -> None:
        try:
            sys._getframe(1)  # a frame below: a handler caught it, and dropped it
        except ValueError:  # none: the top level handled it (`handle_system_exit`)
            if self.status.exit_code is _NOT_SEEN:
                self.status.exit_code = self.code
