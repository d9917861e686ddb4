"""Loaded by Python at start-up in every process `trainspec run` launches (via PYTHONPATH).

With TRAINSPEC_AUTO=1, torchrun's workers (RANK set) are instrumented, and so is a Python
process that `trainspec run` started itself (`trainspec run -- python train.py`: its pid is
TRAINSPEC_RUN_PID) unless it is torchrun's launcher, whose workers are. So is a worker that
multiprocessing starts in a fresh interpreter (`torch.multiprocessing.spawn`, a spawn or
forkserver `Process`): it becomes a rank when it makes a process group, and never before (a
pool worker or a spawned DataLoader worker never does). An instrumented rank takes
TRAINSPEC_AUTO out of its own environment, so the processes it starts (helper scripts,
spawned DataLoader workers) are left alone, as is the launcher; so are the plain children of
a process `trainspec run` started (their parent is not it). Whatever it
does, this file then runs the `sitecustomize` it hides (the next one on sys.path), so a
user's own start-up code runs as it would without trainspec. A failure here is reported and
the script runs uninstrumented: telemetry never stops training.
"""

import os
import sys


def _instrument(group_only: bool) -> None:
    try:
        from trainspec.runtime.auto import install

        install(group_only=group_only)
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


_LAUNCHER_MODULES = ("torch.distributed.run", "torch.distributed.launch")


def _is_launcher() -> bool:
    """Whether this process is torchrun's launcher (`torchrun ...`, `python -m
    torch.distributed.run ...`), from the command line it was started with."""
    argv = list(getattr(sys, "orig_argv", sys.argv))
    if any(os.path.basename(a) == "torchrun" for a in argv[:2]):
        return True
    return any(a == "-m" and b in _LAUNCHER_MODULES for a, b in zip(argv, argv[1:]))


# The `-c` code multiprocessing starts a fresh interpreter with: a spawned worker, or the
# forkserver whose forks are the workers (Python 3.11's multiprocessing/spawn.py, forkserver.py).
_MULTIPROCESSING_CODE = (
    "from multiprocessing.spawn import spawn_main",
    "from multiprocessing.forkserver import main",
)


def _is_multiprocessing_worker() -> bool:
    """Whether multiprocessing started this interpreter (`torch.multiprocessing.spawn`,
    `start_processes`, a spawn or forkserver `Process`), from its command line. Such a
    worker's parent is the script, not `trainspec run`, and it has no RANK: the script
    passes rank and world size to `init_process_group` itself."""
    argv = list(getattr(sys, "orig_argv", sys.argv))
    return any(a == "-c" and b.startswith(_MULTIPROCESSING_CODE) for a, b in zip(argv, argv[1:]))


def _to_instrument() -> bool:
    if os.environ.get("TRAINSPEC_AUTO") != "1":
        return False
    if "RANK" in os.environ:  # a torchrun worker
        return True
    if _is_multiprocessing_worker():  # a rank once it makes a process group
        return True
    started_by_us = os.environ.get("TRAINSPEC_RUN_PID") == str(os.getppid())
    return started_by_us and not _is_launcher()  # `trainspec run -- python train.py`


# The rank's own first: the environment its children inherit, then the user's start-up code
# (before torch is imported, as without trainspec: OMP_NUM_THREADS set there still counts),
# then the instrumentation.
_instrumented = _to_instrument()
if _instrumented and "RANK" in os.environ:
    # A rank's own children are not the job. A process `trainspec run` started itself keeps
    # the variable: its plain children fail the parent-pid test anyway, and the workers of
    # a launcher it runs in-process (`accelerate launch`, `torch.distributed.run.main()`)
    # carry RANK and must be instrumented.
    del os.environ["TRAINSPEC_AUTO"]
_run_the_hidden_sitecustomize()
if _instrumented:
    # A multiprocessing worker keeps TRAINSPEC_AUTO until it makes a group (a worker that
    # starts the ranks itself passes it on); it waits for that group to start measuring.
    _instrument(group_only="RANK" not in os.environ and _is_multiprocessing_worker())
