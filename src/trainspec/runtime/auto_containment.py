"""Failure containment for the zero-code layer (`runtime/auto.py`): every call from a
patched place in torch into the layer goes through `contained`, so a failure of trainspec's
is logged once and counted, and the script goes on."""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from trainspec.runtime.auto_session import AutoSessionLifecycle

log = logging.getLogger("trainspec.runtime")


def contained(auto: AutoSessionLifecycle, entry: Any, *args: Any) -> Any:
    """Call one of the layer's entry points from a patched place in torch. Whatever it
    raises is trainspec's failure, never the script's: logged once, counted, swallowed (a
    nested tensor's `shape`, or parameters on two devices, ended scripts that ran fine
    without trainspec)."""
    try:
        return entry(*args)
    except Exception as exc:  # noqa: BLE001 - telemetry never stops the job
        auto.failures += 1
        if auto.failures == 1:
            log.warning("trainspec: the zero-code instrumentation failed and the script goes on "
                        "(%s: %s)", type(exc).__name__, exc,
                        exc_info=os.environ.get("TRAINSPEC_DEBUG") == "1")  # fmt: skip
        return None
