"""Loaded by Python at start-up in every process `trainspec run` launches (via PYTHONPATH).

Only torchrun's workers (RANK set) with TRAINSPEC_AUTO=1 are instrumented. A worker takes
TRAINSPEC_AUTO out of its own environment once it is instrumented, so the processes it starts
(helper scripts, spawned DataLoader workers) are left alone, as is the launcher. Whatever it
does, this file then runs the `sitecustomize` it hides (the next one on sys.path), so a
user's own start-up code runs as it would without trainspec. A failure here is reported and
the script runs uninstrumented: telemetry never stops training.
"""

import os
import sys


def _instrument() -> None:
    try:
        from trainspec.runtime.auto import install

        install()
    except Exception as exc:  # noqa: BLE001 - must never break the user's script
        print(f"trainspec: instrumentation off: {type(exc).__name__}: {exc}", file=sys.stderr)


def _run_the_hidden_sitecustomize() -> None:
    import importlib.machinery
    import importlib.util

    here = os.path.dirname(os.path.realpath(__file__))
    rest = [p for p in sys.path if os.path.realpath(p or os.curdir) != here]
    try:
        spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
        if spec is None or spec.loader is None or _is_ours(spec.origin):
            return
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    except Exception as exc:  # noqa: BLE001 - as Python reports a failing sitecustomize
        print(f"Error in sitecustomize; set PYTHONVERBOSE for traceback:\n{type(exc).__name__}: "
              f"{exc}", file=sys.stderr)  # fmt: skip
        return
    sys.modules["sitecustomize"] = module


def _is_ours(origin: str | None) -> bool:
    """This file, under any path (another checkout's autoload directory included)."""
    if origin is None:
        return True
    try:
        with (
            open(origin, encoding="utf-8", errors="replace") as theirs,
            open(__file__, encoding="utf-8", errors="replace") as ours,
        ):
            return theirs.read(200) == ours.read(200)
    except OSError:
        return False


# The rank's own first: the environment its children inherit, then the user's start-up code
# (before torch is imported, as without trainspec: OMP_NUM_THREADS set there still counts),
# then the instrumentation.
_instrumented = os.environ.get("TRAINSPEC_AUTO") == "1" and "RANK" in os.environ
if _instrumented:
    del os.environ["TRAINSPEC_AUTO"]  # this process only, not its children
_run_the_hidden_sitecustomize()
if _instrumented:
    _instrument()
