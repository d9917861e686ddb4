"""The wrappers `runtime/auto.py` puts on the process's way out: `sys.excepthook` (an
exception the script did not catch) and `sys.exit` and the `exit()` builtin (a failing exit
code), each telling the zero-code layer before the original runs."""

from __future__ import annotations

import functools
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
